"""Speculative decoding (chapter 15).

- ``rule``: the acceptance rule that keeps the target's distribution, and the plain loop.
- ``drafters``: who guesses: a small model, or n-grams looked up in the prompt.
- ``speculator``: speculation in the engine: a runner that drafts and verifies lone decodes
  beside the core, and the engine ``build_engine`` makes with it.
"""
