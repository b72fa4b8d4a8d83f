"""The paged inference engine (chapters 7 and 8), split by responsibility, in data-flow order.

- ``sequence``: one request's state: its tokens, its status, its block table, its timings.
- ``block_allocator``: a fixed pool of KV-cache blocks, with reference counts and prefix hashes.
- ``scheduler``: who runs this step: admission, the token budget, preemption by recompute.
- ``model_runner``: turns a scheduled batch into tensors and runs one forward pass.
- ``llm_engine``: ``add_request``, ``step`` and ``abort``; ``LLM.generate`` for offline batches.
- ``speculator``: speculative decoding (chapter 12) for steps that decode a single request.

The first three are plain Python, so the scheduling policy can be read and tested without a
model; only the runner touches tensors.
"""

from minillm.engine.llm import LLM, CompletionOutput
from minillm.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from minillm.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
