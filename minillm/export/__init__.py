"""Leaving the project in the ecosystem's formats (chapters 3 and 12).

- ``hf``: a Hugging Face directory that ``transformers`` and llama.cpp's converter read as is.
- ``gguf``: a GGUF file that llama.cpp runs.
"""
