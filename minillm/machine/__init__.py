"""The machine (chapters 0 and 1): what this computer can read and compute, and the roofline
that turns those two numbers into a prediction for a decode step.

- ``hardware``: bandwidth and FLOP/s measured, device specs, timing helpers, dtype names.
- ``roofline``: arithmetic intensity, the ridge point, decode steps placed on the roof.
- ``doctor``: ``python -m minillm.machine.doctor``, a check of Python, torch, device, tokenizer
  and corpus; every chapter's banner.
"""
