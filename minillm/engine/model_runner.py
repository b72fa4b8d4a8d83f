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

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol

import torch

from minillm.engine.kv_cache import AttentionKernels, DecodeGroup, PagedAttention, PagedKVPool, PrefillChunk, slot_of
from minillm.engine.scheduler import ScheduledChunk, SchedulerOutput
from minillm.engine.sequence import Sequence
from minillm.decoding.logprobs import TokenLogprobs
from minillm.model.gpt import GPT
from minillm.decoding.processors import process_, prompt_logprobs
from minillm.decoding.sampling import sample


# Decodes attended together in one call. Larger groups mean fewer calls but more padding
# (every member is padded to the longest); 16 length-sorted sequences keep both small.
DECODE_GROUP = 16
# Prompt rows scored through the LM head at a time: each holds a vocabulary of float32 logits
# and as many log-probabilities (400 KB a row for GPT-2's), so a 2,048-token prefill in one
# piece would hold 800 MB.
SCORE_CHUNK_ROWS = 256


@dataclass
class LaunchedStep:
    """A step whose forward has started: its chunks, decodes first (the order the forward's
    rows are in), and the hidden states, or for a pipelined model the pending forward."""

    output: SchedulerOutput
    ordered: list[ScheduledChunk]
    hidden: object  # a tensor, or something whose wait() returns one


@dataclass
class ChunkOutput:
    """What one scheduled chunk produced: its new ``tokens``; their ``logprobs``, one per token,
    when its request asks; and ``prompt_logprobs`` for the prompt tokens this chunk scored
    (entry ``j`` scores token ``chunk.start + 1 + j``), when its request asks for those."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


class DecodePrograms(Protocol):
    """Another way to run a step of up to ``max_batch`` decodes than the eager forward (the
    captured programs of :mod:`minillm.speedups.decode_graphs`): ``run`` returns the rows'
    logits ``[n, vocab]`` (float32) and their argmax ``[n]``."""

    max_batch: int

    def run(self, decodes: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor]: ...


class ModelRunner:
    """Owns the model and the KV pool's storage; knows nothing about who is waiting."""

    def __init__(self, model: GPT, pool: PagedKVPool, attention: str | AttentionKernels = "torch",
                 graphs: DecodePrograms | None = None) -> None:
        self.model, self.pool = model, pool
        self.attention = attention  # PagedAttention's backend
        self.graphs = graphs
        self.device = model.device

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> list[ChunkOutput]:
        """Run one step; returns, per chunk in ``output.chunks`` order, what it produced (see
        the module docstring). If this raises, no sequence has changed."""
        decodes = sorted((c for c in output.chunks if c.num_tokens == 1), key=lambda c: c.start)
        prefills = [c for c in output.chunks if c.num_tokens > 1]
        if self.graphs is not None and not prefills and len(decodes) <= self.graphs.max_batch:
            logits, greedy = self.graphs.run(decodes)
            drawn = dict(zip(map(id, decodes), _choose([c.seq for c in decodes], logits, greedy)))
            return [drawn[id(c)] for c in output.chunks]
        return self.collect(self.launch(output))

    @torch.inference_mode()
    def launch(self, output: SchedulerOutput) -> LaunchedStep:
        """The eager path's first half: lay the step out and start the forward. A pipelined
        model (:class:`~minillm.distributed.pipeline_workers.PipelineParallelGPT`) returns before its later
        stages finish, so the engine can launch the next micro-batch; any other model runs
        the whole forward here. :meth:`collect` finishes the step."""
        decodes = sorted((c for c in output.chunks if c.num_tokens == 1), key=lambda c: c.start)
        prefills = [c for c in output.chunks if c.num_tokens > 1]
        ordered = decodes + prefills
        tokens, positions, slots = self.flatten(ordered)
        attention = PagedAttention(
            self.pool, slots, self.decode_groups(decodes), self.prefill_chunks(prefills, offset=len(decodes)),
            backend=self.attention,
        )
        start = getattr(self.model, "launch", self.model.hidden_states)
        return LaunchedStep(output, ordered, start(tokens[None], positions[None], attention))

    @torch.inference_mode()
    def collect(self, step: LaunchedStep) -> list[ChunkOutput]:
        """The eager path's second half: the forward's hidden states (waited for, if the model
        is pipelined) to the logits of the rows that sample, and those to tokens."""
        output, ordered = step.output, step.ordered
        hidden = (step.hidden if isinstance(step.hidden, torch.Tensor) else step.hidden.wait())[0]
        ends = torch.tensor(list(accumulate(c.num_tokens for c in ordered)), device=self.device)
        wanted = [i for i, c in enumerate(ordered) if c.samples]
        results = {id(c): ChunkOutput() for c in output.chunks}
        if wanted:
            logits = self.model.logits(hidden[ends[wanted] - 1]).float()
            for i, chosen in zip(wanted, _choose([ordered[i].seq for i in wanted], logits)):
                results[id(ordered[i])] = chosen
        for c, end in zip(ordered, ends.tolist()):
            if c.seq.params.prompt_logprobs is not None and c.start < c.seq.prompt_len - 1:
                results[id(c)].prompt_logprobs = self.score_prompt(c, hidden[end - c.num_tokens : end])
        return [results[id(c)] for c in output.chunks]

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
        """The step's tokens side by side, their positions, and the pool slot each one's key
        and value go to (:func:`~minillm.engine.kv_cache.slot_of`)."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bs = self.pool.block_size
        for c in chunks:
            span = range(c.start, c.start + c.num_tokens)
            tokens += c.seq.token_ids[c.start : c.start + c.num_tokens]
            positions += span
            slots += [slot_of(c.seq.block_table, p, bs) for p in span]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(tokens), as_tensor(positions), as_tensor(slots)

    def decode_groups(self, decodes: list[ScheduledChunk], group_size: int | None = None) -> list[DecodeGroup]:
        """Decodes (already sorted by length) in groups of ``group_size`` (default
        ``DECODE_GROUP``), each with its block tables padded to the group's longest (with the
        pool's pad block, masked out by length)."""
        size = group_size or DECODE_GROUP
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        groups = []
        for start in range(0, len(decodes), size):
            members = decodes[start : start + size]
            lengths = [c.start + 1 for c in members]
            width = -(-max(lengths) // self.pool.block_size)
            tables = [self.pool.table_row(c.seq.block_table, width) for c in members]
            groups.append(DecodeGroup(start, start + len(members), as_tensor(tables), as_tensor(lengths)))
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


def _choose(seqs: list[Sequence], logits: torch.Tensor, greedy: torch.Tensor | None = None) -> list[ChunkOutput]:
    """One token per row of ``logits`` for ``seqs``, with its logprobs where asked.

    The logits processors read and shape, in place, the rows whose requests ask; ``greedy``, the
    rows' argmax when the step computed it already, answers a batch of greedy rows that nothing
    shaped.
    """
    processed = process_(seqs, logits)
    params = [s.params for s in seqs]
    if greedy is not None and not processed.shaped and all(p.greedy for p in params):
        tokens = greedy
    else:
        tokens = sample(logits, params, [s.generator for s in seqs])
    return [ChunkOutput([token], lp) for token, lp in zip(tokens.tolist(), processed.logprobs(tokens))]
