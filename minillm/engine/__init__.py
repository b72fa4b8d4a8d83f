"""The paged inference engine (chapters 7-9), the core the server runs, split by responsibility,
in data-flow order. It imports the model, the data and decoding layers, never a speed-up or a
distributed plug-in: ``build_engine`` wires those in.

- ``sequence``: one request's record: its tokens, status, block table, timings, and what it
  owns while it lives (detokenizer, the seed of its draws, grammar).
- ``block_allocator``: a fixed pool of KV-cache blocks, with reference counts and prefix hashes.
- ``scheduler``: who runs this step: admission, the token budget, preemption by recompute,
  and lookahead slots for speculative decoding.
- ``model_runner``: turns a scheduled batch into tensors and runs one forward pass.
- ``config``: ``EngineConfig``, the pool's size, the step's limits and how the model runs.
- ``llm_engine``: ``add_request``, ``step`` and ``abort``.
- ``build``: ``build_engine``, from weights to an engine (load, cast, quantize, split, draft);
  ``llm``: ``LLM.generate`` for offline batches, on top of it.

The first three are plain Python, so the scheduling policy can be read and tested without a
model; only the runner touches tensors. ``LLM`` and ``build_engine`` load checkpoints and
quantize, so they are imported on first use: ``import minillm.engine`` stays light.
"""

from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine, RequestOutput
from minillm.decoding.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "build_engine"]

_LAZY = {"LLM": "minillm.engine.llm", "CompletionOutput": "minillm.engine.llm", "build_engine": "minillm.engine.build"}


def __getattr__(name: str) -> object:
    """``LLM``, ``CompletionOutput`` and ``build_engine``, imported when first asked for."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
