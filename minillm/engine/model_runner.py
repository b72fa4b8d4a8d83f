"""The model runner: turns the scheduler's decision for one step into tensors and tokens.

It lays the scheduled chunks' tokens out flat, with their positions and the pool slots their
keys and values go to, runs the *same* ``GPT`` the training chapter built, once, and samples a
token for every chunk that reaches the end of its sequence: none for a partial prefill, one for
the others. The LM head runs only on those rows, so a 200-token prompt pays for it once, not
200 times. Logprobs, penalties, biases and schemas act on the same logits, in the same step,
through the logits processors (:mod:`minillm.decoding.processors`).

A step of decodes only, given :class:`DecodePrograms` (``build_engine`` hands in
:class:`~minillm.speedups.decode_graphs.DecodeGraphs`), runs as a captured program instead;
every other step runs the eager path below, which is the reference.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable, Protocol

import torch

from minillm.engine.kv_cache import AttentionKernels, DecodeGroup, PagedAttention, PagedKVPool, PrefillChunk, slot_of
from minillm.engine.scheduler import ScheduledChunk, SchedulerOutput
from minillm.decoding.logprobs import TokenLogprobs
from minillm.model.gpt import GPT
from minillm.decoding.processors import Processed, process_, prompt_logprobs
from minillm.decoding.sampling import sample


# Decodes attended together in one call. Larger groups mean fewer calls but more padding
# (every member is padded to the longest); 16 length-sorted sequences keep both small.
DECODE_GROUP = 16
# Prompt rows scored through the LM head at a time: each holds a vocabulary of float32 logits
# and as many log-probabilities (400 KB a row for GPT-2's), so a 2,048-token prefill in one
# piece would hold 800 MB.
SCORE_CHUNK_ROWS = 256


# The columns of a staged decode's row (:func:`stage_decodes`); its block table follows them
TOKEN, POSITION, SLOT, LENGTH, SOURCE, TABLE = range(6)


@dataclass(frozen=True)
class StagedDecodes:
    """Decodes' inputs copied out of their sequences in one pass, one host tensor (pinned when
    the device is a GPU, so one non-blocking copy takes it there): ``rows`` ``[n, TABLE +
    width]``, a decode each, holding its input token, position, slot and length (new token
    included), the row of the previous step's sampled tokens that holds its token if that is
    still pending (else -1: ``pending`` says whether any is), then the first ``width`` blocks of
    its table (only those are ever read: the length masks the rest)."""

    rows: torch.Tensor
    width: int
    pending: bool


@dataclass
class PreparedStep:
    """One step laid out by the thread that schedules, ready for the thread that computes.

    Everything read from the sequences (tokens, positions, slots, block tables) is copied into
    tensors here, so the sequences may change (the next step scheduled, this one's
    predecessor appended) while the step runs. ``ordered`` is its chunks decodes first (the
    order of the forward's rows), ``sampling`` the chunks that sample, in that order (the rows
    of the sampled tokens). The decodes are ``staged`` (a pending token is copied in on the
    device, from the previous step's sampled tokens, when the step computes); a captured step
    needs nothing else, an eager one its other tensors on the device."""

    output: SchedulerOutput
    ordered: list[ScheduledChunk]
    sampling: list[ScheduledChunk]
    staged: StagedDecodes | None = None
    captured: bool = False
    decode_rows: torch.Tensor | None = None  # for an eager step: ``staged.rows`` on the device
    prefill_tokens: torch.Tensor | None = None  # the prefill chunks' tokens, after the decodes'
    positions: torch.Tensor | None = None
    attention: PagedAttention | None = None
    last_rows: torch.Tensor | None = None  # the flat row of each sampling chunk's last token (None: every row)
    hidden: object = None  # once launched eagerly: hidden states, or something whose wait() gives them


def with_pending(rows: torch.Tensor, pending: bool, sampled: torch.Tensor | None) -> torch.Tensor:
    """The tokens of staged decode ``rows`` (on the device), each pending one (if ``pending``)
    taken from the previous step's ``sampled`` tokens: a gather and a select, no read-back."""
    tokens = rows[:, TOKEN]
    if not pending:
        return tokens
    sources = rows[:, SOURCE]
    return torch.where(sources >= 0, sampled[sources.clamp(min=0)], tokens)


def stage_decodes(decodes: list[ScheduledChunk], pool: PagedKVPool,
                  sources: dict[int, int] | None = None) -> StagedDecodes:
    """Stage ``decodes`` (:class:`StagedDecodes`) in one pass; ``sources`` maps a sequence (by
    ``id``) whose token is pending to its row among the previous step's sampled tokens."""
    bs, pad = pool.block_size, pool.pad_block
    width = -(-(max((c.start for c in decodes), default=0) + 1) // bs)
    rows, pending = [], False
    for c in decodes:
        seq, p = c.seq, c.start
        table = seq.block_table[:width]
        if p < len(seq.token_ids):
            head = [seq.token_ids[p], p, table[p // bs] * bs + p % bs, p + 1, -1]
        else:
            head, pending = [0, p, table[p // bs] * bs + p % bs, p + 1, sources[id(seq)]], True  # type: ignore[index]
        rows.append(head + table + [pad] * (width - len(table)))
    host = torch.tensor(rows, dtype=torch.long).view(len(rows), TABLE + width)
    return StagedDecodes(host.pin_memory() if pool.k.is_cuda else host, width, pending)


@dataclass
class ComputedStep:
    """A step whose tokens are sampled, still on the device: what :meth:`ModelRunner.read`
    turns into outputs."""

    prepared: PreparedStep
    tokens: torch.Tensor  # one sampled token per sampling chunk
    processed: Processed
    hidden: torch.Tensor | None  # the forward's rows, for the prompts being scored
    host_tokens: torch.Tensor | None = None  # ``tokens`` copied to the host, once a queued copy lands


@dataclass
class ChunkOutput:
    """What one scheduled chunk produced: its new ``tokens``; their ``logprobs``, one per token,
    when its request asks; and ``prompt_logprobs`` for the prompt tokens this chunk scored
    (entry ``j`` scores token ``chunk.start + 1 + j``), when its request asks for those."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class StepResult:
    """A submitted step's outputs, once its computation is done: ``wait()`` gives them (or
    raises what the computation raised)."""

    wait: Callable[[], list[ChunkOutput]]


class DecodePrograms(Protocol):
    """Another way to run a step of up to ``max_batch`` decodes than the eager forward (the
    captured programs of :mod:`minillm.speedups.decode_graphs`): ``run`` loads the staged
    decodes (:class:`StagedDecodes`), their pending tokens taken from ``sampled``
    (:func:`with_pending`), and returns the rows' logits ``[n, vocab]`` (float32) and their
    argmax ``[n]``."""

    max_batch: int

    def run(self, staged: StagedDecodes, sampled: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


class ModelRunner:
    """Owns the model and the KV pool's storage; knows nothing about who is waiting.

    A step goes through three methods, so that an engine may run them on two threads:
    :meth:`prepare` (the scheduling thread: copy the step out of its sequences), :meth:`compute`
    (the device's: forward and sample) and :meth:`read` (the sampled tokens to the host).
    :meth:`execute` runs all three in turn."""

    def __init__(self, model: GPT, pool: PagedKVPool, attention: str | AttentionKernels = "torch",
                 graphs: DecodePrograms | None = None) -> None:
        self.model, self.pool = model, pool
        self.attention = attention  # PagedAttention's backend
        self.graphs = graphs
        self.device = model.device
        # the latest prepared step's row of each sampled token, by sequence id (holding no sequence alive)
        self._sampling_rows: dict[int, int] = {}
        self._sampled: torch.Tensor | None = None  # the latest computed step's sampled tokens
        self._device_thread: ThreadPoolExecutor | None = None  # for submit on a CPU
        # submit queues the step on the device and goes on, rather than hand it to a thread
        self.queues_on_device = self.device.type == "cuda"

    def execute(self, output: SchedulerOutput) -> list[ChunkOutput]:
        """Run one step; returns, per chunk in ``output.chunks`` order, what it produced (see
        the module docstring)."""
        return self.execute_prepared(self.prepare(output))

    def submit(self, step: PreparedStep) -> StepResult:
        """Start computing a prepared step and return at once, so the caller can prepare the
        next one meanwhile; the result's ``wait()`` gives its outputs.

        On a CPU the computation runs on a thread of its own (torch releases the interpreter's
        lock inside its operators). On a GPU (``queues_on_device``) it is simply queued: the
        kernels run in order on the device while the host goes on, and the sampled tokens come
        back through a copy queued right behind them, so reading them waits for this step
        only, not the next."""
        if not self.queues_on_device:
            if self._device_thread is None:  # with this thread's torch threads (a new thread has the default)
                self._device_thread = ThreadPoolExecutor(1, thread_name_prefix="minillm-device",
                                                         initializer=torch.set_num_threads,
                                                         initargs=(torch.get_num_threads(),))
            return StepResult(self._device_thread.submit(self.execute_prepared, step).result)
        computed = self.compute(step)
        computed.host_tokens = computed.tokens.to("cpu", non_blocking=True)
        done = torch.cuda.Event() if self.device.type == "cuda" else None
        if done is not None:
            done.record()

        def wait() -> list[ChunkOutput]:
            if done is not None:
                done.synchronize()
            return self.read(computed)

        return StepResult(wait)

    def execute_prepared(self, step: PreparedStep) -> list[ChunkOutput]:
        """:meth:`compute` and :meth:`read` a prepared step: the device's half of every step,
        serial or overlapped (on the device thread)."""
        return self.read(self.compute(step))

    def close(self) -> None:
        """Stop the device thread, if :meth:`submit` started one."""
        if self._device_thread is not None:
            self._device_thread.shutdown()
            self._device_thread = None

    @torch.inference_mode()
    def launch(self, output: SchedulerOutput) -> PreparedStep:
        """Prepare an eager step and start its forward. A pipelined model
        (:class:`~minillm.distributed.pipeline_workers.PipelineParallelGPT`) returns before its
        later stages finish, so the engine can launch the next micro-batch; any other model
        runs the whole forward here. :meth:`collect` finishes the step."""
        step = self.prepare(output, captured=False)
        self._forward(step, getattr(self.model, "launch", self.model.hidden_states))
        return step

    def _forward(self, step: PreparedStep, start: Callable) -> None:
        """Start an eager step's forward with ``start``, its pending tokens copied in first."""
        tokens = with_pending(step.decode_rows, step.staged.pending, self._sampled)
        if step.prefill_tokens is not None:
            tokens = torch.cat([tokens, step.prefill_tokens])
        step.hidden = start(tokens[None], step.positions[None], step.attention)

    def collect(self, step: PreparedStep) -> list[ChunkOutput]:
        """The rest of a step :meth:`launch` started."""
        return self.execute_prepared(step)

    @torch.inference_mode()
    def prepare(self, output: SchedulerOutput, captured: bool | None = None) -> PreparedStep:
        """Copy one step out of its sequences: decodes sorted by length, staged in one pass
        (:func:`stage_decodes`), then prefill chunks; as a captured program's inputs when the
        step is decodes only and fits one (or ``captured`` says), else as the eager forward's
        tokens, positions and attention, with one copy to the device for the decodes and one
        for the prefills."""
        decodes = sorted((c for c in output.chunks if c.num_tokens == 1), key=lambda c: c.start)
        prefills = [c for c in output.chunks if c.num_tokens > 1]
        ordered = decodes + prefills
        sampling = [c for c in ordered if c.samples]
        step = PreparedStep(output, ordered, sampling, stage_decodes(decodes, self.pool, self._sampling_rows))
        self._sampling_rows = {id(c.seq): i for i, c in enumerate(sampling)}
        if captured is None:
            captured = self.graphs is not None and not prefills and len(decodes) <= self.graphs.max_batch
        step.captured = captured
        if captured:
            return step
        step.decode_rows = rows = step.staged.rows.to(self.device, non_blocking=True)
        positions, slots = rows[:, POSITION], rows[:, SLOT]
        if prefills:
            tokens, prefill_positions, prefill_slots = self.flatten(prefills)
            step.prefill_tokens = tokens
            positions, slots = torch.cat([positions, prefill_positions]), torch.cat([slots, prefill_slots])
        step.positions = positions
        step.attention = PagedAttention(self.pool, slots, self.decode_groups(decodes, rows),
                                        self.prefill_chunks(prefills, offset=len(decodes)), backend=self.attention)
        if len(sampling) < len(ordered) or prefills:
            ends = list(accumulate(c.num_tokens for c in ordered))
            step.last_rows = torch.tensor([end - 1 for c, end in zip(ordered, ends) if c.samples],
                                          dtype=torch.long, device=self.device)
        return step

    @torch.inference_mode()
    def compute(self, step: PreparedStep) -> ComputedStep:
        """Run a prepared step's forward (unless :meth:`launch` started it) and sample its
        tokens, leaving them on the device."""
        if step.captured:
            logits, greedy = self.graphs.run(step.staged, self._sampled)
            hidden = None
        else:
            hidden = self.forward(step)
            greedy = None
            last = hidden if step.last_rows is None else hidden[step.last_rows]
            logits = self.model.logits(last).float() if step.sampling else None
        seqs = [c.seq for c in step.sampling]
        processed = process_(seqs, logits) if seqs else Processed()
        if not seqs:
            tokens = torch.empty(0, dtype=torch.long, device=self.device)
        elif greedy is not None and not processed.shaped and all(s.params.greedy for s in seqs):
            tokens = greedy
        else:
            positions = [c.start + c.num_tokens for c in step.sampling]  # the new tokens' indices: what each draws by
            tokens = sample(logits, [s.params for s in seqs], [s.seed for s in seqs], positions)
        self._sampled = tokens
        return ComputedStep(step, tokens, processed, hidden)

    def forward(self, step: PreparedStep) -> torch.Tensor:
        """An eager step's hidden states ``[tokens, d_model]``, one row per input token in
        ``step.ordered``'s order: its forward run (unless :meth:`launch` started it) or waited for."""
        if step.hidden is None:
            self._forward(step, self.model.hidden_states)
        return (step.hidden if isinstance(step.hidden, torch.Tensor) else step.hidden.wait())[0]

    @torch.inference_mode()
    def read(self, computed: ComputedStep) -> list[ChunkOutput]:
        """The sampled tokens (and their logprobs, and prompts' scores where asked) read back:
        one output per chunk, in ``output.chunks`` order."""
        step = computed.prepared
        tokens = computed.tokens
        results = {id(c): ChunkOutput([token], lp) for c, token, lp in
                   zip(step.sampling, (tokens if computed.host_tokens is None else computed.host_tokens).tolist(),
                       computed.processed.logprobs(tokens))}
        outputs = [results.get(id(c)) or ChunkOutput() for c in step.output.chunks]
        if computed.hidden is not None and any(c.seq.params.prompt_logprobs is not None for c in step.ordered):
            by_chunk = {id(c): out for c, out in zip(step.output.chunks, outputs)}
            end = 0
            for c in step.ordered:
                end += c.num_tokens
                if c.seq.params.prompt_logprobs is not None and c.start < c.seq.prompt_len - 1:
                    by_chunk[id(c)].prompt_logprobs = self.score_prompt(c, computed.hidden[end - c.num_tokens : end])
        return outputs

    def score_prompt(self, chunk: ScheduledChunk, hidden: torch.Tensor) -> list[TokenLogprobs]:
        """The prompt tokens after ``chunk``'s positions, scored from its ``hidden`` rows: the
        row at position ``p`` is the model's prediction of token ``p + 1``, so a prompt of
        ``L`` tokens is scored at positions ``0..L-2`` (its first token has no prediction)."""
        seq = chunk.seq
        stop = min(chunk.start + chunk.num_tokens, seq.prompt_len - 1)
        scored: list[TokenLogprobs] = []
        for first in range(chunk.start, stop, SCORE_CHUNK_ROWS):
            last = min(first + SCORE_CHUNK_ROWS, stop)
            rows = hidden[first - chunk.start : last - chunk.start]
            targets = seq.token_ids[first + 1 : last + 1]
            scored += prompt_logprobs(self.model.logits(rows), targets, seq)
        return scored

    def flatten(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefill chunks' tokens side by side, their positions, and the pool slot each one's
        key and value go to (:func:`~minillm.engine.kv_cache.slot_of`), in one copy to the
        device. Every token of a prefill chunk is known: only a decode's input can be pending."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bs = self.pool.block_size
        for c in chunks:
            span = range(c.start, c.start + c.num_tokens)
            known = c.input_tokens()
            if len(known) < c.num_tokens:
                raise RuntimeError(f"request {c.seq.request_id!r}: a chunk of {c.num_tokens} tokens from "
                                   f"{c.start} reaches a token not sampled yet")
            tokens += known
            positions += span
            slots += [slot_of(c.seq.block_table, p, bs) for p in span]
        host = torch.tensor([tokens, positions, slots], dtype=torch.long)
        return host.to(self.device, non_blocking=True).unbind(0)

    def decode_groups(self, decodes: list[ScheduledChunk], rows: torch.Tensor,
                      group_size: int | None = None) -> list[DecodeGroup]:
        """Decodes (already sorted by length) in groups of ``group_size`` (default
        ``DECODE_GROUP``), each with its block tables cut to the group's longest (the staged
        ``rows`` pad them with the pool's pad block, masked out by length): views, no copy."""
        size = group_size or DECODE_GROUP
        groups = []
        for start in range(0, len(decodes), size):
            end = min(start + size, len(decodes))
            width = -(-(decodes[end - 1].start + 1) // self.pool.block_size)
            members = rows[start:end]
            groups.append(DecodeGroup(start, end, members[:, TABLE : TABLE + width], members[:, LENGTH]))
        return groups

    def prefill_chunks(self, prefills: list[ScheduledChunk], offset: int = 0) -> list[PrefillChunk]:
        """Each chunk's rows in the flat batch, from ``offset`` on, and the slots it attends over."""
        bs = self.pool.block_size
        chunks = []
        for c in prefills:
            end = c.start + c.num_tokens
            blocks = torch.tensor(c.seq.block_table[: -(-end // bs)], dtype=torch.long, device=self.device)
            slots = slot_of(blocks, torch.arange(end, device=self.device), bs)
            chunks.append(PrefillChunk(offset, c.num_tokens, slots))
            offset += c.num_tokens
        return chunks

