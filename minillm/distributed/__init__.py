"""One model over several processes (chapter 16), on torch.distributed.

- ``tensor``: weights split by heads and columns; ``tensor_workers`` serves them from worker
  processes; ``tensor_measure`` times it.
- ``pipeline``: layers split into stages; ``pipeline_workers`` serves them, micro-batches
  flowing stage to stage; ``pipeline_measure`` times the bubble.
"""
