"""``EngineConfig``: how big the KV pool is, how much one step may take on, and how the model
runs (split over processes, captured, prepacked). Its checks run on construction, so a bad
option fails before any weights are loaded or processes started; each raises an
:class:`EngineOptionError` naming the option, which the server turns into its flag's name."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.model.config import ModelConfig
from minillm.engine.kv_cache import ATTENTION_BACKENDS, blocks_for_memory
from minillm.sizes import parse_memory

CPU_KV_CACHE_MEMORY = "1GiB"
GPU_MEMORY_FRACTION = 0.9


class EngineOptionError(ValueError):
    """An option that cannot be honoured; ``option`` is its keyword (``"speculative_draft"``)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option, self.message = option, message


@dataclass
class EngineConfig:
    """How big the KV pool is and how much work one step may take on.

    ``kv_cache_memory`` is the KV cache's byte budget (``"6GiB"``): by default 1 GiB on a CPU,
    and on a GPU 90% of the memory free after loading. ``memory_budget`` is the whole process's
    instead: the engine measures the rest by running its largest step, and the cache gets what
    remains (:mod:`minillm.engine.memory`). ``num_blocks`` overrides both (tests force
    preemption with tiny pools). With ``tensor_parallel_size`` processes (split by heads) the
    budgets are per rank; with ``pipeline_parallel_size`` stages (split by blocks) per stage,
    and ``pipeline_micro_batches`` (by default one per stage) batches stay in flight.
    """

    block_size: int = 16
    kv_cache_memory: str | int | None = None
    memory_budget: str | int | None = None
    num_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pipeline_micro_batches: int | None = None
    # "triton": chapter 16's kernels (CUDA, or the interpreter on a CPU); "cpu": the C++ decode
    # attention. None picks, for a model in one process, "triton" on a CUDA GPU where Triton
    # compiles and "cpu" on a CPU where the C++ kernels build (unless enforce_eager=True, the
    # plain reference), else "torch" (build_engine)
    attention: str | None = None
    # Decode-only steps as captured programs (minillm.speedups.decode_graphs, wired in by build_engine):
    # True keeps every step eager (the reference); False captures wherever the model allows (not
    # a tensor-parallel or quantized one); None captures where it is cheap: a CUDA graph records
    # in well under a second, while Inductor compiles for about a minute per batch bucket on a CPU.
    enforce_eager: bool | None = None
    # A copy of the model prepacked for oneDNN (minillm.speedups.packed, by build_engine): True
    # insists, None packs where supported (a CPU's float32, or bfloat16 with AVX-512) unless
    # enforce_eager or memory_budget is given. oneDNN keeps a primitive per batch shape it has
    # run (about 2.6 MB each on the tiny preset), so a packed model grows past any warm-up: it
    # is refused with memory_budget.
    pack_weights: bool | None = None
    # Overlap scheduling (vLLM's async scheduling): schedule and prepare step N+1, and append
    # and detokenize step N's tokens, while N+1 computes. None overlaps on a GPU, whose work runs
    # beside the host's; on a CPU the forward already keeps every core busy, and the host's work
    # beside it slows it by more than it hides (measured: python -m minillm.bench host). False
    # keeps the serial engine, the reference; True insists (one process).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.attention is not None and self.attention not in ATTENTION_BACKENDS:
            raise EngineOptionError("attention", f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, "
                                                 f"got {self.attention!r}")
        if self.attention in ("triton", "cpu") and self.tensor_parallel_size > 1:
            raise EngineOptionError("attention", f"attention={self.attention!r} runs on one device; use it with "
                                                 "tensor_parallel_size=1")
        for name in ("tensor_parallel_size", "pipeline_micro_batches", "block_size", "max_num_seqs",
                     "max_num_batched_tokens", "num_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise EngineOptionError(name, f"{name} must be >= 1, got {getattr(self, name)}")
        self._check_pipeline()
        if self.async_scheduling and (self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1):
            raise EngineOptionError("async_scheduling", "async_scheduling=True runs the model in this process; it does "
                                    "not combine with tensor_parallel_size or pipeline_parallel_size > 1 (not supported)")
        for name in ("kv_cache_memory", "memory_budget"):
            try:
                if getattr(self, name) is not None:
                    parse_memory(getattr(self, name))
            except ValueError as err:
                raise EngineOptionError(name, str(err)) from None
        if self.memory_budget is not None:
            if self.kv_cache_memory is not None or self.num_blocks is not None:
                raise EngineOptionError(
                    "memory_budget", "memory_budget sizes the KV cache from the whole process's memory, "
                    "kv_cache_memory and num_blocks size it alone: give one of them"
                )
            if self.pack_weights:
                raise EngineOptionError("pack_weights", "pack_weights=True does not combine with memory_budget: "
                                        "oneDNN's per-shape primitives grow past what a warm-up measures (see "
                                        "EngineConfig.pack_weights)")

    def _check_pipeline(self) -> None:
        """What pipeline parallelism refuses: a bad size, and the options it does not combine with."""
        size = self.pipeline_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise EngineOptionError("pipeline_parallel_size", "pipeline_parallel_size (--pipeline-parallel-size) "
                                    f"must be an integer >= 1, got {size!r}")
        if size == 1:
            return
        clashes = {
            "tensor_parallel_size > 1": self.tensor_parallel_size > 1,
            "attention='triton'": self.attention == "triton",
            "attention='cpu'": self.attention == "cpu",
            "memory_budget": self.memory_budget is not None,
            "enforce_eager=False": self.enforce_eager is False,
            "pack_weights=True": self.pack_weights is True,
        }
        for option, clash in clashes.items():
            if clash:
                raise EngineOptionError("pipeline_parallel_size", "pipeline_parallel_size (--pipeline-parallel-size) "
                                        f"> 1 does not combine with {option} (not supported: its stages run eagerly, "
                                        "one process and one device each)")

    @property
    def micro_batches(self) -> int:
        """Batches the engine keeps in flight: 1 unless the model is split into stages."""
        if self.pipeline_parallel_size == 1:
            return 1
        return self.pipeline_micro_batches or self.pipeline_parallel_size

    def pool_blocks(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, beside_per_token: int = 0) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_memory is not None:
            budget = parse_memory(self.kv_cache_memory)
        elif device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(device)[0] * GPU_MEMORY_FRACTION)
        else:
            budget = parse_memory(CPU_KV_CACHE_MEMORY)
        blocks = blocks_for_memory(cfg, dtype, self.block_size, budget, beside_per_token)
        if blocks < 1:
            raise EngineOptionError("kv_cache_memory", f"a KV cache of {budget} bytes holds not even one block of "
                                                       f"{self.block_size} tokens")
        return blocks
