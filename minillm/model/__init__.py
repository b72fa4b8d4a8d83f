"""The GPT (chapter 3): one forward for training, the naive loop, the caches and the engine.

- ``config``: ``ModelConfig`` and the named presets.
- ``gpt``: the model, its KV-cache protocol, and the counts of parameters and FLOPs.
- ``losses``: cross-entropy computed through the tied head in chunks.
- ``checkpoint``: saving and loading weights with their config.
"""
