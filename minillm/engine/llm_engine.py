"""The engine: requests in, tokens out, one scheduler step at a time.

``LLMEngine`` wires the pieces of chapters 7 and 8 together. ``add_request`` checks and
queues a request; each ``step()`` asks the scheduler who runs, has the model runner compute
and sample, appends each new token to its sequence, detokenizes it (holding back half
characters and possible stop strings), and lets the scheduler retire finished sequences and
free their blocks. The server (chapter 9) calls ``step()`` in a loop; ``LLM.generate`` does
the same for a fixed list of prompts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from minillm.config import ModelConfig
from minillm.detokenizer import IncrementalDetokenizer
from minillm.engine.block_allocator import BlockAllocator
from minillm.engine.kv_cache import ATTENTION_BACKENDS, PagedKVPool, blocks_for_memory, parse_memory
from minillm.engine.model_runner import ModelRunner
from minillm.engine.scheduler import Scheduler, SchedulerOutput
from minillm.engine.speculator import Speculator
from minillm.engine.sequence import FinishReason, Sequence
from minillm.model import GPT
from minillm.sampling import SamplingParams
from minillm.speculative import Draft
from minillm.tokenizer import Tokenizer, get_tokenizer

CPU_KV_CACHE_MEMORY = "1GiB"
GPU_MEMORY_FRACTION = 0.9


@dataclass
class EngineConfig:
    """How big the KV pool is and how much work one step may take on.

    ``kv_cache_memory`` is a byte budget (``"6GiB"``); by default 1 GiB on a CPU, and on a GPU
    90% of the memory left free after the model is loaded. ``num_blocks`` overrides it (tests
    use tiny pools to force preemption). ``tensor_parallel_size`` splits the model over that
    many processes (``minillm.parallel``); the KV budget is then per rank, each holding its heads.
    """

    block_size: int = 16
    kv_cache_memory: str | int | None = None
    num_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    attention: str = "torch"  # "triton": chapter 13's kernels (CUDA, or the interpreter on a CPU)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention!r}")
        if self.attention == "triton" and self.tensor_parallel_size > 1:
            raise ValueError("attention='triton' runs on one device; use it with tensor_parallel_size=1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)

    def pool_blocks(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_memory is not None:
            budget = parse_memory(self.kv_cache_memory)
        elif device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(device)[0] * GPU_MEMORY_FRACTION)
        else:
            budget = parse_memory(CPU_KV_CACHE_MEMORY)
        blocks = blocks_for_memory(cfg, dtype, self.block_size, budget)
        if blocks < 1:
            raise ValueError(f"a KV cache of {budget} bytes holds not even one block of {self.block_size} tokens")
        return blocks


@dataclass
class RequestOutput:
    """What one step produced for one request: its new tokens and the text now safe to show."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_tokens: int  # slots holding a computed token, over the running sequences
    preemptions: int
    prefix_cache_hit_rate: float
    steps: int
    prefill_tokens: int  # prompt tokens computed, recomputation after preemption included
    generated_tokens: int

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


class LLMEngine:
    """The paged, continuously batched engine over one ``GPT``."""

    def __init__(
        self,
        model: GPT,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        """``speculator``: speculative decoding for steps that decode a single request
        (:mod:`minillm.engine.speculator`); batched steps run as usual."""
        config = config or EngineConfig()
        if config.tensor_parallel_size > 1:  # this process is rank 0; the other shards run in workers
            from minillm.parallel_engine import TensorParallelGPT  # (it imports this package)

            model = TensorParallelGPT(model.eval(), config.tensor_parallel_size)  # type: ignore[assignment]
        self.model = model.eval()
        self.config = config
        self.tokenizer = tokenizer or get_tokenizer()
        weight = model.tok_emb.weight
        if self.config.attention == "triton":  # fail now, not in the first request
            _require_triton(weight.device)
        num_blocks = self.config.pool_blocks(model.cfg, weight.dtype, weight.device)
        self.pool = PagedKVPool(model.cfg, num_blocks, self.config.block_size, weight.device, weight.dtype)
        self.allocator = BlockAllocator(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.allocator,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=model.cfg.context_length,
            enable_chunked_prefill=self.config.enable_chunked_prefill,
        )
        self.runner = ModelRunner(model, self.pool, self.config.attention)
        self.speculator = speculator
        self._sequences: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._steps = self._prefill_tokens = self._generated = 0
        self.last_step: SchedulerOutput | None = None  # what the latest step ran, for timelines and dashboards

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Sequence:
        """Queue a request. Raises ``ValueError`` (a ``RequestRejected``) if it can never run."""
        if request_id in self._sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.model.cfg.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in 0..{vocab - 1}")
        seq = Sequence(
            request_id=request_id,
            token_ids=ids,
            prompt_len=len(ids),
            params=params,
            max_model_len=self.model.cfg.context_length,
            eos_token_id=self.tokenizer.eot,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        )
        self.scheduler.add(seq)
        self._sequences[request_id] = seq
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        return seq

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for every request that advanced."""
        output = self.scheduler.schedule(time.monotonic())
        self.last_step = output
        if output.is_empty:
            return []
        if self.speculator is not None and self.speculator.applies(output):
            return self._speculative_step(output)
        tokens = self.runner.execute(output)  # if this raises, no sequence has changed
        now = time.monotonic()
        results: dict[str, RequestOutput] = {}
        try:
            for chunk, token in zip(output.chunks, tokens):
                is_decode = chunk.num_tokens == 1 and chunk.start >= chunk.seq.prompt_len
                self._prefill_tokens += 0 if is_decode else chunk.num_tokens
                if token is not None:
                    self._generated += 1
                    results[chunk.seq.request_id] = self._append(chunk.seq, token, now)
        finally:  # even if appending failed, finished sequences must give their blocks back
            for seq in self.scheduler.postprocess(output, now):
                self._retire(seq.request_id)
        self._steps += 1
        return list(results.values())

    def _speculative_step(self, output: SchedulerOutput) -> list[RequestOutput]:
        """The one running request's decode, with draft tokens checked in the same forward:
        room is made for the draft's slots (or the step runs without a draft), the runner
        verifies, and every accepted token plus the next one is appended, as one output."""
        chunk = output.chunks[0]
        seq = chunk.seq
        generator = self.runner.generator(chunk)
        draft = self.speculator.propose(seq, generator)
        if not self.allocator.can_allocate(seq, seq.num_tokens + len(draft)):
            draft = Draft()
        self.allocator.grow(seq, seq.num_tokens + len(draft))
        accepted, token = self.runner.verify(chunk, draft, generator)
        emitted = draft.tokens[:accepted] + [token]
        self.speculator.stats.record(len(draft), accepted, len(emitted))
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        try:
            for t in emitted:
                outputs.append(self._append(seq, t, now))
                if seq.is_finished:
                    break
            self._generated += len(outputs)
            chunk.num_tokens = len(outputs)  # so postprocess advances past the accepted tokens only
        finally:
            for finished in self.scheduler.postprocess(output, now):
                self._retire(finished.request_id)
        self._steps += 1
        last = outputs[-1]
        last.new_token_ids = [t for out in outputs for t in out.new_token_ids]
        last.new_text = "".join(out.new_text for out in outputs)
        return [last]

    def _append(self, seq: Sequence, token: int, now: float) -> RequestOutput:
        seq.append_token(token, now)
        detok = self._detokenizers[seq.request_id]
        ended_by_token = seq.finish_reason is FinishReason.STOP
        text = "" if ended_by_token else detok.add(token)
        if detok.stopped and not seq.is_finished:
            seq.finish(FinishReason.STOP, now)
        if seq.is_finished and not detok.stopped:
            text += detok.flush()
        return RequestOutput(
            seq.request_id,
            [token],
            text,
            seq.is_finished,
            seq.finish_reason.value if seq.finish_reason else None,
            seq.prompt_len,
            seq.num_output_tokens,
        )

    def abort(self, request_id: str) -> bool:
        """Stop a request now (its client went away); its blocks return to the pool."""
        seq = self.scheduler.abort(request_id, time.monotonic())
        if seq is None:
            return False
        self._retire(request_id)
        return True

    def _retire(self, request_id: str) -> None:
        self._sequences.pop(request_id, None)
        self._detokenizers.pop(request_id, None)
        self.runner.forget(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def close(self) -> None:
        """Release what outlives the engine's steps: a tensor-parallel model's worker processes."""
        close = getattr(self.model, "close", None)
        if close is not None:
            close()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            kv_blocks_used=self.allocator.num_used_blocks,
            kv_blocks_total=self.allocator.num_blocks,
            kv_tokens=sum(seq.num_computed_tokens for seq in self.scheduler.running),
            preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_rate=self.allocator.prefix_hit_rate,
            steps=self._steps,
            prefill_tokens=self._prefill_tokens,
            generated_tokens=self._generated,
        )


def _require_triton(device: torch.device) -> None:
    """A ``ValueError`` that says why ``attention="triton"`` cannot run on ``device``."""
    from minillm.kernels.runtime import TritonUnavailable, require_triton

    try:
        require_triton(device)
    except TritonUnavailable as err:
        raise ValueError(f"attention='triton' cannot run here: {err}") from None
