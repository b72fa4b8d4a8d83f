"""``build_engine``: from weights to a ready engine, the one sequence ``LLM`` and
``python -m server`` share.

Each later chapter plugs in here rather than into the engine: load, cast or quantize (chapter
14), split over processes (17), draft (15), pack, capture and pick kernels (12 and 16). A
failure one option caused raises :class:`EngineOptionError` naming it, for the server's flag.
"""

from __future__ import annotations

from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from minillm.distributed.rendezvous import is_worker_rank, launched, telling_the_launch
from minillm.model.checkpoint import load_model, load_state, model_from_state
from minillm.engine.config import EngineConfig, EngineOptionError
from minillm.engine.kv_cache import AttentionKernels
from minillm.engine.llm_engine import LLMEngine, Speedups
from minillm.engine.memory import MemoryBudgetError
from minillm.speedups import gemv
from minillm.speedups.decode_graphs import Capture, capture_mode, capture_unsupported
from minillm.speedups.packed import pack_weights, packing_unsupported
from minillm.speedups.speculative.speculator import SpeculativeEngine, Speculator
from minillm.speedups.speculative.draft_vocab import draft_vocabulary, training_token_counts
from minillm.model.gpt import GPT, fused_attention
from minillm.speedups.quant import cast_and_quantize, check_scheme
from minillm.data.tokenizer import Tokenizer
from minillm.machine.hardware import resolve_dtype

NGRAM = "ngram"  # the speculative_draft value that asks for prompt lookup instead of a model


def build_engine(
    model: GPT | str | Path | None,
    config: EngineConfig | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    quantize: str | None = None,
    speculative_draft: GPT | str | Path | None = None,
    num_speculative_tokens: int = 4,
    speculative_disable_by_batch_size: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> LLMEngine:
    """An engine over ``model`` (a ``GPT``, moved to ``device`` and cast in place, or a checkpoint
    path, loaded onto ``device``, the CPU by default). ``quantize="int8"`` or ``"int4"`` stores
    the matrices in that many bits, with bf16 activations unless ``dtype`` says otherwise.
    ``speculative_draft`` (a draft ``GPT``, its checkpoint, or ``"ngram"``) speculates up to
    ``num_speculative_tokens`` per decoding sequence (chapter 15), in steps of at most
    ``speculative_disable_by_batch_size`` sequences (None: up to the batch size where the
    speculator measures that it stops paying). Split models start worker processes, which
    ``engine.close()`` stops. In a worker rank of a torchrun launch, this serves rank 0 (which
    sends the weights: ``model`` may be None there) and ends the process."""
    config = config or EngineConfig()
    options = dict(dtype=dtype, quantize=quantize, speculative_draft=speculative_draft,
                   num_speculative_tokens=num_speculative_tokens,
                   speculative_disable_by_batch_size=speculative_disable_by_batch_size)

    def settings() -> dict:
        check_options(config, **options)
        check_launch(config)
        return launch_settings(config, **options)

    if is_worker_rank():  # it serves rank 0 its part of the model, then exits
        from minillm.distributed.follower import follow

        raise SystemExit(follow(settings))
    with telling_the_launch():  # a failure here is posted for the launch's other ranks, which wait for us
        return _build_rank_0(model, config, device, options, tokenizer, settings())


def _build_rank_0(model: GPT | str | Path, config: EngineConfig, device: str | torch.device | None,
                  options: dict, tokenizer: Tokenizer | None, settings: dict) -> LLMEngine:
    """``build_engine`` in the process that runs the engine (rank 0 of a split model)."""
    if model is None:
        raise TypeError("build_engine needs a model (a GPT or a checkpoint path)")
    dtype, quantize = options["dtype"], options["quantize"]
    model = load_weights(model, device)
    try:  # check_options has vetted the dtype and the scheme: what is left is the model's shape
        cast_and_quantize(model, resolve_dtype(dtype), quantize)
    except ValueError as err:
        raise EngineOptionError("quantize", str(err)) from None
    speculator = build_speculator(options["speculative_draft"], model, options["num_speculative_tokens"],
                                  options["speculative_disable_by_batch_size"],
                                  prepare=lambda draft: packed_if_asked(draft, config))
    if config.tensor_parallel_size > 1:  # this process becomes rank 0; the other shards run in workers
        from minillm.distributed.tensor_workers import TensorParallelGPT  # starts processes: only when asked

        model = TensorParallelGPT(model.eval(), config.tensor_parallel_size, settings=settings)  # type: ignore[assignment]
    if config.pipeline_parallel_size > 1:  # stage 0 here, one worker per later stage
        from minillm.distributed.pipeline_workers import PipelineParallelGPT

        try:  # a bad size is refused before any process starts
            model = PipelineParallelGPT(model.eval(), config.pipeline_parallel_size,  # type: ignore[assignment]
                                        settings=settings)
        except EngineOptionError:  # another option at fault (ranks that disagree on it)
            raise
        except ValueError as err:
            raise EngineOptionError("pipeline_parallel_size", str(err)) from None
    try:
        model, speedups = plug_in(model, config)
        return make_engine(model, config, tokenizer, speculator, speedups)
    except BaseException as err:
        close = getattr(model, "close", None)  # workers already started must not outlive a failure
        if close is not None:
            close()
        if isinstance(err, MemoryBudgetError):
            raise EngineOptionError("memory_budget", str(err)) from None
        raise


def check_launch(config: EngineConfig) -> None:
    """Under torchrun, refuse a split that does not use exactly the launched ranks (every rank
    checks, so all of them fail at once, each saying why)."""
    rank = launched()
    if rank is None:
        return
    split = config.tensor_parallel_size * config.pipeline_parallel_size
    if split != rank.world_size:
        option = "pipeline_parallel_size" if config.pipeline_parallel_size > 1 else "tensor_parallel_size"
        raise EngineOptionError(option, f"torchrun launched {rank.world_size} ranks (--nnodes x --nproc-per-node), "
                                f"but the model is split over {split}: {option} must be {rank.world_size}")


def launch_settings(config: EngineConfig, **options: object) -> dict:
    """What every rank of a torchrun launch must be given alike: the engine's configuration and
    :func:`build_engine`'s options (a model or path as its name), compared by rank 0 at the
    rendezvous. The device is not among them: each rank has its own."""
    def comparable(value: object) -> object:
        if isinstance(value, (bool, int, float, str, type(None))):
            return value
        return type(value).__name__ if isinstance(value, torch.nn.Module) else str(value)

    return {name: comparable(value) for name, value in {**asdict(config), **options}.items()}


def make_engine(model: GPT, config: EngineConfig, tokenizer: Tokenizer | None, speculator: Speculator | None,
                speedups: Speedups) -> LLMEngine:
    """The plain :class:`LLMEngine`, or one that drives its runner differently (pipeline
    micro-batches in flight, or speculative steps)."""
    if config.micro_batches > 1:
        from minillm.distributed.pipeline_workers import PipelinedEngine

        return PipelinedEngine(model, config, tokenizer, speedups)
    if speculator is not None:
        return SpeculativeEngine(model, config, tokenizer, speedups, speculator=speculator)
    return LLMEngine(model, config, tokenizer, speedups)


def plug_in(model: GPT, config: EngineConfig) -> tuple[GPT, Speedups]:
    """The model the engine runs (``model``, or its weight-packed copy) and the plug-ins
    ``config`` asks for (captured decode steps, Triton attention), each decided here once."""
    model = model.eval()
    kernels = attention_kernels(config, model.device, model.dtype)
    reason = eager_reason(model, config)
    capture = None if reason is not None else Capture(model, config.max_num_seqs, kernels, capture_mode(model.device))
    return packed_if_asked(model, config), Speedups(kernels, capture, reason)


def eager_reason(model: GPT, config: EngineConfig) -> str | None:
    """Why every step runs eagerly, or None when decode steps are captured (see
    ``enforce_eager``): ``config`` asks for it and the model is one the captured programs,
    whose buckets cover ``max_num_seqs`` rows, can run."""
    if config.enforce_eager or (config.enforce_eager is None and model.device.type != "cuda"):
        return "enforce_eager" if config.enforce_eager else "a CPU compiles only when asked (enforce_eager=False)"
    return capture_unsupported(model)


def packed_if_asked(model: GPT, config: EngineConfig) -> GPT:
    """``model`` itself, or its weight-packed copy (``pack_weights``: None packs where it is
    supported, unless ``enforce_eager`` or ``memory_budget`` is given)."""
    pack = config.pack_weights
    if pack is None:
        pack = not config.enforce_eager and config.memory_budget is None
    reason = packing_unsupported(model) if pack else None
    if pack and reason is None:
        return pack_weights(model)
    if config.pack_weights:
        raise EngineOptionError("pack_weights", f"pack_weights=True: {reason}")
    return model


def attention_kernels(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> AttentionKernels | None:
    """The kernels ``config.attention`` names (None for the torch paths), checked now to run
    on ``device`` rather than failing in the first request: chapter 16's Triton kernels, or
    the CPU's C++ decode attention.

    ``attention=None`` takes them for a model in one process: Triton on a CUDA GPU where it
    compiles (a captured step's torch attention gathers every row's whole block table, since
    it cannot ask the device how long the longest row is without stalling, where the paged
    kernel stops at each row's length; on an H200 the engine decoded 5.1x as many tokens/s with
    it, the GPU check's attention step, 64 requests of 128 tokens), the C++ kernel on a CPU
    where it builds, unless ``enforce_eager`` asks for the plain reference path (the gather,
    its mask and its fused call cost about 300 us a layer in a compiled step at batch 1 on a
    2-core Xeon, the kernel 47)."""
    attention = config.attention
    if attention is None:
        one_process = config.tensor_parallel_size == config.pipeline_parallel_size == 1
        if one_process and device.type == "cuda" and triton_compiles():
            attention = "triton"
        elif one_process and device.type == "cpu" and not config.enforce_eager and dtype in gemv.DTYPES and gemv.load():
            attention = "cpu"
    if attention == "cpu":
        if device.type != "cpu" or dtype not in gemv.DTYPES:
            raise EngineOptionError("attention", f"attention='cpu' needs float32 or bfloat16 on a CPU, not {dtype} "
                                                 f"on {device}")
        if not gemv.load():
            raise EngineOptionError("attention", "attention='cpu' needs the C++ kernels built (minillm/speedups/"
                                                 "gemv.py could not build them here: see its warning)")
        return AttentionKernels("cpu", gemv.paged_decode, fused_attention)
    if attention != "triton":
        return None
    from minillm.speedups.kernels.runtime import TritonUnavailable, require_triton  # sets TRITON_INTERPRET

    try:
        require_triton(device)
    except TritonUnavailable as err:
        raise EngineOptionError("attention", f"attention='triton' cannot run here: {err}") from None
    from minillm.speedups.kernels.flash_triton import flash_attention
    from minillm.speedups.kernels.paged_triton import paged_decode_attention

    return AttentionKernels("triton", paged_decode_attention, partial(flash_attention, causal=True))


def triton_compiles() -> bool:
    """Triton is installed and compiles its kernels for the GPU (not the interpreter)."""
    from minillm.speedups.kernels.runtime import interpreting, triton_installed

    return triton_installed() and not interpreting()


def check_options(config: EngineConfig, *, dtype: str | torch.dtype | None = None, quantize: str | None = None,
                  speculative_draft: object = None, num_speculative_tokens: int = 4,
                  speculative_disable_by_batch_size: int | None = None) -> None:
    """Refuse, before any weights load, what :func:`build_engine`'s own options cannot do, alone
    or with ``config``: an :class:`EngineOptionError` naming the option. The server calls it
    on its flags, so that it and ``LLM`` accept exactly the same options. (A split slices the
    float ``nn.Linear`` weights quantization replaces; a pipelined engine has no speculative step.)"""
    try:
        resolve_dtype(dtype)
    except ValueError as err:
        raise EngineOptionError("dtype", str(err)) from None
    if quantize is not None:
        try:
            check_scheme(quantize)
        except ValueError as err:
            raise EngineOptionError("quantize", str(err)) from None
    for size in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(config, size) > 1 and quantize is not None:
            raise EngineOptionError("quantize", f"quantize does not combine with {size} > 1 (not supported)")
    if speculative_draft is None:
        return
    if config.pipeline_parallel_size > 1:
        raise EngineOptionError("speculative_draft",
                                "speculative_draft does not combine with pipeline_parallel_size > 1 (not supported)")
    if num_speculative_tokens < 1:
        raise EngineOptionError("num_speculative_tokens",
                                f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    if speculative_disable_by_batch_size is not None and speculative_disable_by_batch_size < 1:
        raise EngineOptionError("speculative_disable_by_batch_size", "speculative_disable_by_batch_size must be "
                                f">= 1 (or unset: measured), got {speculative_disable_by_batch_size}")


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


def build_speculator(draft: GPT | str | Path | None, target: GPT, num_speculative_tokens: int,
                     disable_by_batch_size: int | None = None,
                     prepare: Callable[[GPT], GPT] | None = None) -> Speculator | None:
    """``None`` for no speculation, ``"ngram"`` for prompt lookup, a ``GPT`` or a checkpoint
    path for a draft model (loaded onto the target's device and dtype, then ``prepare``d). A
    checkpoint that knows its training text's tokens drafts among those alone
    (:mod:`~minillm.speedups.speculative.draft_vocab`); a ``GPT`` drafts among all."""
    if draft is None:
        return None
    try:
        if draft == NGRAM:
            return Speculator.with_ngram(num_speculative_tokens, disable_by_batch_size=disable_by_batch_size)
        vocabulary = None
        if not isinstance(draft, GPT):
            state = load_state(draft)
            counts = training_token_counts(state)
            vocabulary = None if counts is None else draft_vocabulary(counts)
            draft = model_from_state(state, target.device)
        return Speculator.with_draft_model(draft, target, num_speculative_tokens, disable_by_batch_size, prepare,
                                           vocabulary)
    except (FileNotFoundError, ValueError) as err:
        raise EngineOptionError("speculative_draft", str(err)) from None
