"""``build_engine``: from weights to a ready engine, the one sequence ``LLM`` and
``python -m server`` share.

Each later chapter plugs in here rather than into the engine: load the weights (a ``GPT`` or
a checkpoint path) onto the device; cast them, or quantize them (chapter 13); split them over
processes, by heads or by layers (chapter 16); choose a drafter (chapter 14); then build the
:class:`LLMEngine`. A failure that one option caused raises :class:`EngineOptionError` naming
that option, so the server can name its flag.
"""

from __future__ import annotations

from pathlib import Path

import torch

from minillm.model.checkpoint import load_model
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.memory import MemoryBudgetError
from minillm.speedups.speculative.speculator import Speculator
from minillm.model.gpt import GPT
from minillm.speedups.quant import cast_and_quantize
from minillm.data.tokenizer import Tokenizer
from minillm.machine.hardware import resolve_dtype

NGRAM = "ngram"  # the speculative_draft value that asks for prompt lookup instead of a model


class EngineOptionError(ValueError):
    """An option that cannot be honoured; ``option`` is its keyword (``"speculative_draft"``)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option, self.message = option, message


def build_engine(
    model: GPT | str | Path,
    config: EngineConfig | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    quantize: str | None = None,
    speculative_draft: GPT | str | Path | None = None,
    num_speculative_tokens: int = 4,
    tokenizer: Tokenizer | None = None,
) -> LLMEngine:
    """An engine over ``model`` (a ``GPT``, moved to ``device`` and cast in place, or a checkpoint
    path, loaded onto ``device``, the CPU by default). ``quantize="int8"`` or ``"int4"`` stores
    the matrices in that many bits, with bf16 activations unless ``dtype`` says otherwise.
    ``config.tensor_parallel_size > 1`` starts that many worker processes (``engine.close()``
    stops them), as does ``config.pipeline_parallel_size > 1``, one per stage after the first. ``speculative_draft``: a draft ``GPT``, its checkpoint, or ``"ngram"``.
    A ``config.memory_budget`` too small for the model is an :class:`EngineOptionError`
    naming ``memory_budget``."""
    config = config or EngineConfig()
    model = load_weights(model, device)
    for size in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(config, size) == 1:
            continue
        if quantize is not None:
            raise EngineOptionError("quantize", f"quantize does not combine with {size} > 1 (not supported)")
        if speculative_draft is not None and size == "pipeline_parallel_size":
            raise EngineOptionError("speculative_draft",
                                    f"speculative_draft does not combine with {size} > 1 (not supported)")
    try:
        cast_and_quantize(model, resolve_dtype(dtype), quantize)
    except ValueError as err:
        raise EngineOptionError("quantize" if quantize is not None else "dtype", str(err)) from None
    speculator = build_speculator(speculative_draft, model, num_speculative_tokens)
    if config.tensor_parallel_size > 1:  # this process becomes rank 0; the other shards run in workers
        from minillm.distributed.tensor_workers import TensorParallelGPT  # spawns processes: only when asked

        model = TensorParallelGPT(model.eval(), config.tensor_parallel_size)  # type: ignore[assignment]
    if config.pipeline_parallel_size > 1:  # stage 0 here, one worker process per later stage
        from minillm.distributed.pipeline_workers import PipelineParallelGPT

        try:  # a bad size is refused before any process starts
            model = PipelineParallelGPT(model.eval(), config.pipeline_parallel_size)  # type: ignore[assignment]
        except ValueError as err:
            raise EngineOptionError("pipeline_parallel_size", str(err)) from None
    try:
        return LLMEngine(model, config, tokenizer, speculator)
    except BaseException as err:
        close = getattr(model, "close", None)  # workers already started must not outlive a failure
        if close is not None:
            close()
        if isinstance(err, MemoryBudgetError):
            raise EngineOptionError("memory_budget", str(err)) from None
        raise


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` that works here: an absent GPU fails now, in one line."""
    try:
        target = torch.device(device)
        torch.empty(1, device=target)
    except (RuntimeError, AssertionError) as err:
        raise EngineOptionError("device", f"device {device}: {str(err).splitlines()[0]}") from None
    return target


def load_weights(model: GPT | str | Path, device: str | torch.device | None) -> GPT:
    """``model`` on ``device`` (kept where it is when ``device`` is None): a ``GPT`` is moved in
    place, a path is loaded. Errors name the option at fault."""
    target = check_device(device) if device is not None else None
    if isinstance(model, GPT):
        return model.to(device=target)
    try:
        return load_model(model, target or "cpu")
    except FileNotFoundError as err:
        raise EngineOptionError("checkpoint", str(err)) from None


def build_speculator(draft: GPT | str | Path | None, target: GPT, num_speculative_tokens: int) -> Speculator | None:
    """``None`` for no speculation, ``"ngram"`` for prompt lookup, a ``GPT`` or a checkpoint
    path for a draft model (loaded onto the target's device and dtype)."""
    if draft is None:
        return None
    if num_speculative_tokens < 1:
        raise EngineOptionError("num_speculative_tokens", f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    try:
        if draft == NGRAM:
            return Speculator.with_ngram(num_speculative_tokens)
        if not isinstance(draft, GPT):
            draft = load_model(draft, target.device)
        return Speculator.with_draft_model(draft, target, num_speculative_tokens)
    except (FileNotFoundError, ValueError) as err:
        raise EngineOptionError("speculative_draft", str(err)) from None
