"""Going faster (chapters 12-16): plug-ins the engine is built with, never imports.

- ``packed``: weights prepacked for oneDNN, the roads for one and a few rows timed per shape
  (chapter 12).
- ``gemv``: a C++ kernel for a few rows that reads each weight once, built on first use (chapter 12).
- ``decode_graphs``, ``graph_attention``: decode steps padded to buckets and captured
  (torch.compile on a CPU, CUDA graphs on a GPU) (chapter 12).
- ``quant``: int8 and int4 weights and their kernels (chapter 14).
- ``speculative``: drafting and verifying several tokens in one pass (chapter 15).
- ``kernels``: online softmax, tiled attention, FlashAttention and paged decode in Triton
  (chapter 16).
"""
