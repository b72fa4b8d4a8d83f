"""One model over several processes (chapter 17), on torch.distributed.

- ``rendezvous``: how the ranks meet: launched by torchrun on one host or several, or spawned
  by rank 0 on this machine; either way each worker finds rank 0 through the launch's store
  and connects to it.
- ``workers``: the one bootstrap tensor and pipeline parallelism share: each worker follows
  rank 0 over its connection (each step's inputs in, its last words out); rank 0 starts or
  meets its workers, joins a process group with them, and stops them.
- ``tensor``: weights split by heads and columns; ``tensor_workers`` serves them from worker
  processes; ``tensor_measure`` times it.
- ``pipeline``: layers split into stages; ``pipeline_workers`` serves them, micro-batches
  flowing stage to stage (``PipelinedEngine`` keeps several in flight); ``pipeline_measure``
  times the bubble.
"""
