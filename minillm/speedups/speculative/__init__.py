"""Speculative decoding (chapter 14).

- ``rule``: the acceptance rule that keeps the target's distribution, and the plain loop.
- ``drafters``: who guesses: a small model, or n-grams looked up in the prompt.
- ``speculator``: drafting and verifying inside the engine's step.
"""
