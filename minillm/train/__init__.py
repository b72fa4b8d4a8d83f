"""Training (chapter 4): ``python -m minillm.train``.

- ``trainer``: the loop (schedule, mixed precision, evaluation, checkpoints, several GPUs
  through torchrun) and ``load_or_train``, which later chapters and the server call.
- ``__main__``: the command's flags.
"""
