"""One model over several processes (chapter 17), on torch.distributed.

- ``workers``: the one bootstrap tensor and pipeline parallelism share: rank 0 starts worker
  processes, joins a process group with them, sends each step's inputs down a pipe, and
  stops them.
- ``tensor``: weights split by heads and columns; ``tensor_workers`` serves them from worker
  processes; ``tensor_measure`` times it.
- ``pipeline``: layers split into stages; ``pipeline_workers`` serves them, micro-batches
  flowing stage to stage (``PipelinedEngine`` keeps several in flight); ``pipeline_measure``
  times the bubble.
"""
