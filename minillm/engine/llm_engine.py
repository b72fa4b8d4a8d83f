"""The engine: requests in, tokens out, one scheduler step at a time.

``LLMEngine`` wires the pieces of chapters 7 and 8 together. ``add_request`` checks a request
and queues its ``Sequence``, the request's one record (its tokens, blocks, detokenizer, random
generator and timestamps). Each ``step()`` asks the scheduler who runs, has the model runner
compute and sample, appends each new token to its sequence, detokenizes it (holding back half
characters and possible stop strings), and lets the scheduler retire finished sequences and
free their blocks; a retired sequence is referenced by nothing in the engine any more. The
server (chapter 9) calls ``step()`` in a loop; ``LLM.generate`` does the same for a fixed list
of prompts.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from minillm.decoding.detokenizer import IncrementalDetokenizer
from minillm.engine.block_allocator import BlockAllocator
from minillm.engine.config import EngineConfig
from minillm.speedups.decode_graphs import DecodeGraphs, capture_mode, capture_unsupported
from minillm.engine.kv_cache import PagedKVPool
from minillm.engine.memory import MemorySplit, measure
from minillm.engine.model_runner import ChunkOutput, LaunchedStep, ModelRunner
from minillm.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from minillm.engine.sequence import FinishReason, RequestTimes, Sequence
from minillm.speedups.speculative.speculator import Speculator
from minillm.decoding.logprobs import TokenLogprobs
from minillm.model.gpt import GPT
from minillm.speedups.packed import pack_weights, packing_unsupported
from minillm.decoding.sampling import SamplingParams, make_generator
from minillm.decoding.structured import GrammarCompiler
from minillm.data.tokenizer import Tokenizer, get_tokenizer


@dataclass
class RequestOutput:
    """What one step produced for one request: its new tokens and the text now safe to show.
    ``times`` is set on a request's last output, so its reader needs nothing else from the
    engine to report queue time, TTFT and inter-token latency.

    ``logprobs`` (one per new token) and ``prompt_logprobs`` (entry ``j`` scores prompt token
    ``j + 1``, on the request's first output only) are set when its ``SamplingParams`` ask.
    ``cached_tokens`` is how much of the prompt the prefix cache held at its admission."""

    request_id: str
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
    """The paged, continuously batched engine over one ``GPT`` (or a model that acts as one:
    quantized, or rank 0 of a tensor-parallel split)."""

    def __init__(
        self,
        model: GPT,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        """``speculator``: speculative decoding for steps that decode a single request
        (:mod:`minillm.speedups.speculative.speculator`); batched steps run as usual."""
        config = config or EngineConfig()
        if getattr(model, "world_size", 1) != config.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={config.tensor_parallel_size} needs the model split over that many "
                "processes: build the engine with minillm.engine.build_engine (or LLM), which starts them"
            )
        if getattr(model, "num_stages", 1) != config.pipeline_parallel_size:
            raise ValueError(
                f"pipeline_parallel_size={config.pipeline_parallel_size} needs the model split into that many stages: "
                "build the engine with minillm.engine.build_engine (or LLM), which starts them"
            )
        plain = model.eval()
        self.model = model = _engine_model(plain, config)
        self.config = config
        self.tokenizer = tokenizer or get_tokenizer()
        self.grammars = GrammarCompiler(self.tokenizer)  # for requests held to a JSON Schema
        if config.attention == "triton":  # fail now, not in the first request
            _require_triton(model.device)
        self.eager_reason = _eager_reason(plain, config)
        capture = capture_mode(model.device) if self.eager_reason is None else None
        # the split of memory_budget, measured by a warm-up step; None when the cache was sized alone
        self.memory: MemorySplit | None = None
        if config.memory_budget is not None:
            self.memory = measure(model, plain, config.memory_budget, block_size=config.block_size,
                                  max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                                  attention=config.attention, capture=capture)
        # every stage's pool has as many blocks (the block tables are shared): the largest sizes them
        sizing_cfg = getattr(model, "largest_stage_cfg", model.cfg)
        num_blocks = self.memory.blocks if self.memory else config.pool_blocks(sizing_cfg, model.dtype, model.device)
        self.pool = PagedKVPool(model.cfg, num_blocks, config.block_size, model.device, model.dtype)
        self.allocator = BlockAllocator(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.allocator,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=model.cfg.context_length,
            enable_chunked_prefill=config.enable_chunked_prefill,
            num_lookahead_slots=speculator.k if speculator is not None else 0,
        )
        self.graphs = None if capture is None else DecodeGraphs(plain, self.pool, config.max_num_seqs, config.attention)
        self.runner = ModelRunner(model, self.pool, config.attention, speculator, self.graphs)
        self._steps = self._prefill_tokens = self._generated = 0
        self._in_flight: deque[LaunchedStep] = deque()  # pipelined micro-batches, oldest first
        self.last_step: SchedulerOutput | None = None  # what the latest step ran, for timelines and dashboards

    @property
    def speculator(self) -> Speculator | None:
        return self.runner.speculator

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Sequence:
        """Queue a request. Raises ``ValueError`` (a ``RequestRejected``) if it can never run."""
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
            prompt_len=len(ids),
            params=params,
            max_model_len=self.model.cfg.context_length,
            eos_token_id=self.tokenizer.eot,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop),
            generator=make_generator(params, self.model.device),
            grammar=None if params.json_schema is None else self.grammars.compile(params.json_schema),
        )
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for every request that advanced. With a
        pipelined model, one micro-batch's step (see :meth:`pipelined_step`)."""
        if self.config.micro_batches > 1:
            return self.pipelined_step()
        output = self.scheduler.schedule(time.monotonic())
        self.last_step = output
        if output.is_empty:
            return []
        produced = self.runner.execute(output)  # if this raises, no sequence has changed
        return self._finish_step(output, produced)

    def pipelined_step(self) -> list[RequestOutput]:
        """Keep ``micro_batches`` batches in flight through the pipeline's stages, then finish
        the oldest. Each new micro-batch is scheduled from the sequences not already in
        flight, with an even share of the unfinished requests, so the micro-batches come out
        of similar size; while stage 1 works on one, rank 0 computes stage 0 of the next.
        Sequences in flight are never preempted (their keys are still being written): the
        scheduler takes its victims from the others, or waits."""
        depth = self.config.micro_batches
        while len(self._in_flight) < depth:
            busy = {id(c.seq) for launched in self._in_flight for c in launched.output.chunks}
            share = -(-(self.scheduler.num_running + self.scheduler.num_waiting) // depth)
            output = self.scheduler.schedule(time.monotonic(), busy=busy, max_seqs=max(1, share))
            if output.is_empty:
                break
            self.last_step = output
            self._in_flight.append(self.runner.launch(output))
        if not self._in_flight:
            return []
        launched = self._in_flight.popleft()
        return self._finish_step(launched.output, self.runner.collect(launched))

    def _finish_step(self, output: SchedulerOutput, produced: list[ChunkOutput]) -> list[RequestOutput]:
        """Append what a step produced to its sequences, then let the scheduler account for it."""
        now = time.monotonic()
        results: list[RequestOutput] = []
        try:
            for chunk, made in zip(output.chunks, produced):
                if chunk.seq.finish_reason is FinishReason.ABORT:  # aborted while its micro-batch ran
                    continue
                self._prefill_tokens += 0 if chunk.is_decode else chunk.num_tokens
                if made.prompt_logprobs:
                    chunk.seq.record_prompt_logprobs(chunk.start, made.prompt_logprobs)
                if made.tokens:
                    results.append(self._append(chunk, made, now))
        finally:  # even if appending failed, finished sequences must give their blocks back
            self.scheduler.postprocess(output, now)
        self._steps += 1
        return results

    def _append(self, chunk: ScheduledChunk, made: ChunkOutput, now: float) -> RequestOutput:
        """Append a chunk's new tokens (more than one after an accepted draft) up to the one
        that finishes the request, and turn them into the text now safe to show. A request
        with ``max_tokens=0`` wanted its prompt scored only: it finishes here, and the token
        sampled after its prompt is dropped."""
        seq, detok = chunk.seq, chunk.seq.detokenizer
        first_output = seq.first_token_time is None
        tokens = made.tokens
        if seq.params.max_tokens == 0:
            seq.first_token_time, tokens = now, []
            seq.finish(FinishReason.LENGTH, now)
        appended, text = [], []
        for token in tokens:
            seq.append_token(token, now)
            appended.append(token)
            if not seq.is_stop_token(token):
                text.append(detok.add(token))
            if detok.stopped and not seq.is_finished:
                seq.finish(FinishReason.STOP, now)
            if seq.is_finished:
                break
        if seq.is_finished and not detok.stopped:
            text.append(detok.flush())
        self._generated += len(appended)
        return RequestOutput(
            seq.request_id,
            appended,
            "".join(text),
            seq.is_finished,
            seq.finish_reason.value if seq.finish_reason else None,
            seq.prompt_len,
            seq.num_output_tokens,
            seq.times() if seq.is_finished else None,
            made.logprobs[: len(appended)] if made.logprobs is not None else None,
            seq.prompt_logprobs if first_output and seq.params.prompt_logprobs is not None else None,
            min(seq.num_cached_prompt_tokens, seq.prompt_len),
        )

    def abort(self, request_id: str) -> bool:
        """Stop a request now (its client went away); its blocks return to the pool."""
        return self.scheduler.abort(request_id, time.monotonic()) is not None

    @property
    def unfinished_request_ids(self) -> list[str]:
        """Every request still waiting or running, oldest first."""
        return self.scheduler.unfinished_request_ids

    def close(self) -> None:
        """Release what outlives the engine's steps: a tensor-parallel model's worker processes."""
        close = getattr(self.model, "close", None)
        if close is not None:
            close()

    @property
    def has_unfinished(self) -> bool:
        """Requests waiting or running, or a micro-batch still in flight (even an aborted one's)."""
        return self.scheduler.has_unfinished or bool(self._in_flight)

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


def _eager_reason(model: GPT, config: EngineConfig) -> str | None:
    """Why every step runs eagerly, or None when decode steps are captured (see
    ``enforce_eager``): ``config`` asks for it and the model is one the captured programs,
    whose buckets cover ``max_num_seqs`` rows, can run."""
    if config.enforce_eager or (config.enforce_eager is None and model.device.type != "cuda"):
        return "enforce_eager" if config.enforce_eager else "a CPU compiles only when asked (enforce_eager=False)"
    return capture_unsupported(model)


def _engine_model(model: GPT, config: EngineConfig) -> GPT:
    """The model the engine runs: ``model`` itself, or its weight-packed copy (``pack_weights``)."""
    if config.pack_weights is not None:
        pack = config.pack_weights
    else:
        pack = not config.enforce_eager and config.memory_budget is None
    if not pack:
        return model
    reason = packing_unsupported(model)
    if reason is None:
        return pack_weights(model)
    if config.pack_weights:
        raise ValueError(f"pack_weights=True: {reason}")
    return model


def _require_triton(device: torch.device) -> None:
    """A ``ValueError`` that says why ``attention="triton"`` cannot run on ``device``."""
    from minillm.speedups.kernels.runtime import TritonUnavailable, require_triton

    try:
        require_triton(device)
    except TritonUnavailable as err:
        raise ValueError(f"attention='triton' cannot run here: {err}") from None
