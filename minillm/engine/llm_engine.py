"""The engine: requests in, tokens out, one scheduler step at a time.

``LLMEngine`` wires chapters 7 and 8 together: ``add_request`` queues a request's
``Sequence``; each ``step()`` asks the scheduler who runs, has the model runner compute and
sample, appends and detokenizes the new tokens, and lets the scheduler retire the finished.
The server (chapter 9) calls ``step()`` in a loop; ``LLM.generate`` does for a fixed batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Hashable, Protocol

from minillm.decoding.detokenizer import IncrementalDetokenizer
from minillm.engine.block_allocator import BlockAllocator
from minillm.engine.config import EngineConfig
from minillm.engine.kv_cache import AttentionKernels, PagedKVPool
from minillm.engine.memory import MemorySplit, measure
from minillm.engine.model_runner import ChunkOutput, DecodePrograms, ModelRunner, StepResult
from minillm.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from minillm.engine.sequence import RequestTimes, Sequence, SequenceStatus
from minillm.decoding.logprobs import TokenLogprobs
from minillm.decoding.processors import shapes_logits
from minillm.model.gpt import GPT
from minillm.decoding.sampling import FinishReason, SamplingParams, request_seed
from minillm.decoding.structured import grammar_compiler
from minillm.data.tokenizer import Tokenizer, get_tokenizer


class EngineDead(RuntimeError):
    """The engine cannot take another step (a split model's worker has gone): whoever drives it
    should stop, not retry."""


@dataclass
class RequestOutput:
    """What one step produced for one request: its new tokens and the text now safe to show.
    ``times`` is set on a request's last output, so its reader needs nothing else from the
    engine to report queue time, TTFT and inter-token latency.

    ``logprobs`` (one per new token) and ``prompt_logprobs`` (entry ``j`` scores prompt token
    ``j + 1``, on the request's first output only) are set when its ``SamplingParams`` ask.
    ``cached_tokens`` is how much of the prompt the prefix cache held at its admission."""

    request_id: Hashable
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    times: RequestTimes | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    cached_tokens: int = 0


@dataclass
class EngineStats:
    """What the engine holds and has done, as of the latest step: a snapshot that a reader on
    another thread (the server's dashboard and metrics) may keep, since it refers to nothing
    in the engine."""

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
    batch_size: int  # sequences in the latest step's batch (0 before the first)
    computing: bool = False  # an overlapped step still computing (it may hold finished requests' blocks)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


class Capture(Protocol):
    """Captured decode programs to come (:class:`minillm.speedups.decode_graphs.Capture`): what
    they will hold, given the measured decode peak (for the memory budget), then the programs
    over the pool the engine sized."""

    def graph_bytes(self, decode_peak: int) -> int: ...

    def __call__(self, pool: PagedKVPool) -> DecodePrograms: ...


@dataclass(frozen=True)
class Speedups:
    """What :func:`~minillm.engine.build.build_engine` plugs into the engine: ``kernels`` for
    ``attention="triton"``; ``capture`` for decode steps run as captured programs, or else
    ``eager_reason``, why they run eagerly. (Packed weights come as the model itself.)"""

    kernels: AttentionKernels | None = None
    capture: Capture | None = None
    eager_reason: str | None = None


class LLMEngine:
    """The paged, continuously batched engine over one ``GPT`` (or a model that acts as one:
    quantized, packed, or rank 0 of a split over processes).

    Constructed directly it is the plain core: every step eager, the model as handed over; an
    option that asks for a plug-in outright is refused, since only ``build_engine`` wires
    plug-ins in, through ``speedups``."""

    def __init__(
        self,
        model: GPT,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        speedups: Speedups | None = None,
    ) -> None:
        config = config or EngineConfig()
        speedups = _plain_core(config) if speedups is None else speedups
        for option, parts in (("tensor_parallel_size", "world_size"), ("pipeline_parallel_size", "num_stages")):
            if getattr(model, parts, 1) != getattr(config, option):
                raise ValueError(f"{option}={getattr(config, option)} needs the model split over that many "
                                 "processes: build the engine with minillm.engine.build_engine (or LLM)")
        self.model = model = model.eval()
        self.config = config
        self.tokenizer = tokenizer or get_tokenizer()
        self.grammars = grammar_compiler(self.tokenizer)  # for requests held to a JSON Schema: shared with the server
        self.eager_reason = speedups.eager_reason
        attention = speedups.kernels or config.attention or "torch"
        self.attention_name = attention if isinstance(attention, str) else attention.name  # what reads the KV cache
        # the split of memory_budget, measured by a warm-up step; None when the cache was sized alone
        self.memory: MemorySplit | None = None
        if config.memory_budget is not None:
            graph_bytes = speedups.capture.graph_bytes if speedups.capture is not None else None
            self.memory = measure(model, config.memory_budget, block_size=config.block_size,
                                  max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                                  attention=attention, graph_bytes=graph_bytes,
                                  beside_per_token=self.kv_bytes_beside_per_token())
        # every stage's pool has as many blocks (the block tables are shared): the largest sizes them
        sizing_cfg = getattr(model, "largest_stage_cfg", model.cfg)
        num_blocks = self.memory.blocks if self.memory else config.pool_blocks(
            sizing_cfg, model.dtype, model.device, self.kv_bytes_beside_per_token())
        self.pool = PagedKVPool(model.cfg, num_blocks, config.block_size, model.device, model.dtype)
        self.allocator = BlockAllocator(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.allocator,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=model.cfg.context_length,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.graphs = None if speedups.capture is None else speedups.capture(self.pool)
        self.runner = ModelRunner(model, self.pool, attention, self.graphs)
        self._steps = self._prefill_tokens = self._generated = 0
        self.last_step: SchedulerOutput | None = None  # what the latest step ran, for timelines and dashboards
        # Overlap scheduling (config.async_scheduling): by default on a GPU, never for a split model
        overlap = config.async_scheduling if config.async_scheduling is not None else model.device.type == "cuda"
        self.overlap = overlap and config.tensor_parallel_size == config.pipeline_parallel_size == 1
        self._computing: tuple[SchedulerOutput, StepResult] | None = None  # the step computing, overlapped

    def add_request(
        self,
        request_id: Hashable,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Sequence:
        """Queue a request under ``request_id``, any hashable key unique among the unfinished
        requests. Raises ``ValueError`` (a ``RequestRejected``) if it can never run."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.model.cfg.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in 0..{vocab - 1}")
        if any(t >= vocab for t in params.logit_bias):  # SamplingParams checked the rest
            raise ValueError(f"logit_bias token ids must be in 0..{vocab - 1}")
        if params.max_tokens == 0 and len(ids) < 2:
            raise ValueError("max_tokens=0 scores a prompt, which needs at least 2 tokens (the first has no logprob)")
        seq = Sequence(
            request_id=request_id,
            token_ids=ids,
            params=params,
            max_model_len=self.model.cfg.context_length,
            eos_token_id=self.tokenizer.eot,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop),
            seed=request_seed(params),
            grammar=None if params.json_schema is None else self.grammars.compile(params.json_schema),
        )
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for every request that advanced."""
        if self.overlap:
            return self._overlapped_step()
        output = self.scheduler.schedule(time.monotonic())
        self.last_step = output
        return [] if output.is_empty else self._run(output)

    def _run(self, output: SchedulerOutput) -> list[RequestOutput]:
        """Run a scheduled step to its end and append what it produced."""
        try:
            produced = self.runner.execute(output)
        except BaseException:
            self.scheduler.abandon(output)  # so no sequence has changed
            raise
        return self._finish_step(output, produced)

    def _overlapped_step(self) -> list[RequestOutput]:
        """Schedule and start step N+1, then append step N's tokens while N+1 computes.

        N+1 is scheduled before N's tokens are known: each sequence's next input is a pending
        token, which the device copies from N's sampled tokens. So a request that N finishes
        (an end-of-text token, a stop string) is in N+1 too; its token from N+1 is dropped,
        and its blocks are freed once N+1 is accounted for. A step with rows whose logits
        depend on every earlier token (penalties, a schema's grammar) starts only after N's
        tokens are appended: it overlaps nothing but stays exact.

        A step with draft slots (speculative decoding) also waits for N, since its drafter reads
        each sequence's latest token, and it runs to its end before the next step is scheduled:
        how many tokens it accepts decides where each sequence's next step starts. So a
        speculating engine overlaps the steps that do not speculate (the large batches, past
        the size where speculation stops paying) and runs the others serially."""
        output = self.scheduler.schedule(time.monotonic())  # if this raises, the step computing stays so
        previous, self._computing = self._computing, None
        self.last_step = output
        results: list[RequestOutput] = []
        if not output.is_empty:
            drafts = any(c.num_lookahead for c in output.chunks)
            if previous is not None and (drafts or any(c.samples and shapes_logits(c.seq) for c in output.chunks)):
                results, previous = self._collect(previous, output), None
            if drafts:
                return results + self._run(output)
            try:
                self._computing = (output, self.runner.submit(self.runner.prepare(output)))
            except BaseException:
                self._abandon_after_failure(previous, output)
                raise
        if previous is not None:
            results = self._collect(previous, output if self._computing else None)
        return results

    def _collect(self, launched: tuple[SchedulerOutput, StepResult],
                 later: SchedulerOutput | None) -> list[RequestOutput]:
        """Wait for a step's tokens and append them. If that fails, the step launched ``later``
        is waited for and undone, and both are ``last_step``."""
        output, result = launched
        try:
            produced = result.wait()
        except BaseException:
            self._abandon_after_failure(launched, later)
            raise
        try:
            return self._finish_step(output, produced)
        except BaseException:  # the step is accounted for (its finished requests freed); the later one is not
            self._abandon_after_failure(None, later)
            self.last_step = SchedulerOutput(output.chunks + self.last_step.chunks)
            raise

    def _abandon_after_failure(self, failed: tuple[SchedulerOutput, StepResult] | None,
                               later: SchedulerOutput | None) -> None:
        """Undo the steps not accounted for, newest first, once none is still computing, and
        name them all ``last_step``: the requests a server must end."""
        for launched in (failed, self._computing):
            if launched is not None:
                try:
                    launched[1].wait()
                except BaseException:
                    pass  # failed: undone below all the same
        self._computing = None
        chunks: list[ScheduledChunk] = []
        if later is not None:
            self.scheduler.abandon(later)
            chunks += later.chunks
        if failed is not None:
            self.scheduler.abandon(failed[0])
            chunks = failed[0].chunks + chunks
        self.last_step = SchedulerOutput(chunks)

    def _finish_step(self, output: SchedulerOutput, produced: list[ChunkOutput]) -> list[RequestOutput]:
        """Append what a step produced to its sequences, then let the scheduler account for it.
        A sequence already finished (aborted while the step ran, or finished by the step
        before, seen late by an overlapped engine) takes nothing from it."""
        now = time.monotonic()
        results: list[RequestOutput] = []
        try:
            for chunk, made in zip(output.chunks, produced):
                if chunk.seq.status is SequenceStatus.FINISHED:
                    continue
                if not chunk.is_decode:
                    self._prefill_tokens += chunk.num_tokens
                if made.prompt_logprobs:
                    chunk.seq.record_prompt_logprobs(chunk.start, made.prompt_logprobs)
                if made.tokens:
                    results.append(self._append(chunk.seq, made, now))
        finally:  # even if appending failed, finished sequences must give their blocks back
            self.scheduler.postprocess(output)
        self._steps += 1
        return results

    def _append(self, seq: Sequence, made: ChunkOutput, now: float) -> RequestOutput:
        """Append a chunk's new tokens (several after an accepted draft) up to the one that
        finishes the request, and turn them into the text now safe to show. A request with
        ``max_tokens=0`` wanted its prompt scored only: its sampled token is dropped."""
        detok, params = seq.detokenizer, seq.params
        first_output = seq.first_token_time is None
        tokens = made.tokens
        if params.max_tokens == 0:
            seq.first_token_time, tokens = now, []
            seq.finish(FinishReason.LENGTH, now)
        text = []
        for n, token in enumerate(tokens, 1):
            seq.append_token(token, now)
            if not params.stops_on(token, seq.eos_token_id):
                text.append(detok.add(token))
            if detok.stop_reason is not None and seq.status is not SequenceStatus.FINISHED:
                seq.finish(FinishReason.STOP, now)
            if seq.status is SequenceStatus.FINISHED:
                tokens = tokens[:n]
                break
        finished = seq.status is SequenceStatus.FINISHED
        if finished and detok.stop_reason is None:
            text.append(detok.flush())
        self._generated += len(tokens)
        return RequestOutput(
            seq.request_id,
            tokens,
            text[0] if len(text) == 1 else "".join(text),
            finished,
            seq.finish_reason.value if seq.finish_reason else None,
            seq.prompt_len,
            len(seq.token_ids) - seq.prompt_len,
            seq.times() if finished else None,
            made.logprobs[: len(tokens)] if made.logprobs is not None else None,
            seq.prompt_logprobs if first_output and params.prompt_logprobs is not None else None,
            min(seq.num_cached_prompt_tokens, seq.prompt_len),
        )

    def abort(self, request_id: Hashable) -> bool:
        """Stop a request now (its client went away); its blocks return to the pool."""
        return self.scheduler.abort(request_id, time.monotonic()) is not None

    @property
    def unfinished_request_ids(self) -> list[Hashable]:
        """Every request still waiting or running, oldest first."""
        return self.scheduler.unfinished_request_ids

    @property
    def queued_request_ids(self) -> list[Hashable]:
        """The requests never scheduled yet, oldest first: nothing computed, nothing sent, so a
        server shutting down can refuse them outright."""
        return self.scheduler.queued_request_ids

    def kv_bytes_beside_per_token(self) -> int:
        """Bytes per token slot of the pool that a cache beside it holds (a draft model's, which
        mirrors the pool's blocks): the pool is sized so that both fit the cache's budget. 0 in
        the plain engine."""
        return 0

    def check_alive(self) -> None:
        """Raise :class:`EngineDead` if the engine can no longer step: a split model checks its
        workers (a model in this one process is always alive). Cheap enough to ask when idle."""
        check = getattr(self.model, "check_alive", None)
        if check is not None:
            check()

    def close(self) -> None:
        """Release what outlives the engine's steps: the device thread, a split model's worker
        processes."""
        if self._computing is not None:
            self._computing[1].wait()
            self._computing = None
        self.runner.close()
        close = getattr(self.model, "close", None)
        if close is not None:
            close()

    @property
    def has_unfinished(self) -> bool:
        """Requests waiting or running, or a step still computing (even if only for finished ones)."""
        return self.scheduler.has_unfinished or self._computing is not None

    @property
    def num_queued(self) -> int:
        """Requests waiting beyond the seats free in the batch: what a server bounds its queue
        by. Requests join the batch only when a step is scheduled, so a burst that arrives
        between two steps waits in full at first; counting only what its free seats cannot
        take keeps a server from refusing work while seats stand empty."""
        free_seats = max(0, self.config.max_num_seqs - len(self.scheduler.running))
        return max(0, self.scheduler.num_waiting - free_seats)

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=self.scheduler.num_waiting,
            kv_blocks_used=self.allocator.num_used_blocks,
            kv_blocks_total=self.allocator.num_blocks,
            kv_tokens=sum(seq.num_computed_tokens for seq in self.scheduler.running),
            preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_rate=self.allocator.prefix_hit_rate,
            steps=self._steps,
            prefill_tokens=self._prefill_tokens,
            generated_tokens=self._generated,
            batch_size=len(self.last_step.chunks) if self.last_step is not None else 0,
            computing=self._computing is not None,
        )


def _plain_core(config: EngineConfig) -> Speedups:
    """The plain core's plug-ins: none. An option that asks for one outright is refused."""
    asks = {"enforce_eager=False": config.enforce_eager is False, "pack_weights=True": config.pack_weights is True,
            "attention='triton'": config.attention == "triton", "attention='cpu'": config.attention == "cpu"}
    for option, asked in asks.items():
        if asked:
            raise ValueError(f"{option} needs a plug-in: build the engine with minillm.engine.build_engine (or LLM), "
                             "which wires it in")
    return Speedups(eager_reason="enforce_eager" if config.enforce_eager else "a plain LLMEngine (build_engine captures)")
