"""Speculative decoding (chapter 15).

- ``rule``: the acceptance rule that keeps the target's distribution, and the plain loop.
- ``drafters``: who guesses for one sequence: a small model, or n-grams looked up in the prompt.
- ``batch_drafters``: who guesses for a whole batch: the draft model over every sequence at
  once, its cache paged like the target's.
- ``crossover``: where speculation stops paying, from the engine's own steps, timed.
- ``speculator``: speculation in the engine: a runner that drafts and verifies every decode of
  a step beside the core, and the engine ``build_engine`` makes with it.
"""
