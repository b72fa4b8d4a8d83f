"""The model runner: turns the scheduler's decision for one step into tensors and tokens.

For each scheduled chunk (a sequence and a run of its tokens to compute) it lays the tokens
out flat, with their positions and the pool slots their keys and values go to, builds the
block tables the attention reads through, runs the *same* ``GPT`` the training chapter built,
once, and samples a token for every chunk that reaches the end of its sequence. The LM head,
a ``d_model x 50,257`` matmul per token, runs only on those rows: a 200-token prompt pays for
it once, not 200 times.

A decode the scheduler gave lookahead slots is speculative decoding's step (chapter 14): the
runner drafts into those slots and verifies the draft in the same single forward pass, so it
returns a list of tokens per chunk: none for a partial prefill, one for most chunks, the
accepted drafts plus one more for a speculative decode.

What a request asks beyond a token comes from the same logits, in the same step: penalties and
biases adjust its row before sampling (:mod:`minillm.decoding.penalties`), a schema masks it
(:mod:`minillm.decoding.structured`), logprobs score the chosen token from the raw row
(:mod:`minillm.decoding.logprobs`), and prompt logprobs run the LM head over the prompt rows of its
prefill, which every other request skips.

A step of decodes only, given :class:`~minillm.speedups.decode_graphs.DecodeGraphs`, runs as a
captured program instead (a CUDA graph, or Inductor's compiled code on a CPU); every other
step, and every step with ``enforce_eager``, runs the eager path below, which is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minillm.speedups.decode_graphs import DecodeGraphs
from minillm.engine.kv_cache import DecodeGroup, PagedAttention, PagedKVPool, PrefillChunk
from minillm.engine.scheduler import ScheduledChunk, SchedulerOutput
from minillm.engine.sequence import Sequence
from minillm.speedups.speculative.speculator import Speculator
from minillm.decoding.logprobs import TokenLogprobs, token_logprobs
from minillm.model.gpt import GPT
from minillm.decoding.penalties import adjust_logits_
from minillm.decoding.sampling import sample
from minillm.decoding.structured import mask_logits_, token_bias
from minillm.speedups.speculative.rule import Draft, accept


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


class ModelRunner:
    """Owns the model and the KV pool's storage; knows nothing about who is waiting."""

    def __init__(self, model: GPT, pool: PagedKVPool, attention: str = "torch",
                 speculator: Speculator | None = None, graphs: DecodeGraphs | None = None) -> None:
        self.model, self.pool = model, pool
        self.attention = attention  # an ATTENTION_BACKENDS name: see PagedAttention
        self.speculator = speculator
        self.graphs = graphs
        self.device = model.device

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> list[ChunkOutput]:
        """Run one step; returns, per chunk in ``output.chunks`` order, what it produced (see
        the module docstring). If this raises, no sequence has changed."""
        if len(output.chunks) == 1 and output.chunks[0].num_lookahead:
            return [ChunkOutput(self.speculate(output.chunks[0]))]
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
            self.pool, slots, self.decode_groups(decodes), self._prefill_chunks(prefills, offset=len(decodes)),
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
        ends = torch.tensor(_cumulative_ends(ordered), device=self.device)
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
            scored += token_logprobs(self.model.logits(rows), targets, [seq.params.prompt_logprobs] * len(targets))
        return scored

    def speculate(self, chunk: ScheduledChunk) -> list[int]:
        """A decode with ``chunk.num_lookahead`` reserved slots: draft that many tokens at
        most, verify them, and return the accepted drafts plus the next token."""
        draft = self.speculator.propose(chunk.seq, chunk.num_lookahead)
        accepted, token = self.verify(chunk, draft)
        self.speculator.stats.record(len(draft), accepted, accepted + 1)
        return draft.tokens[:accepted] + [token]

    def verify(self, chunk: ScheduledChunk, draft: Draft) -> tuple[int, int]:
        """Speculative decoding's check (chapter 14): run the target once over the sequence's
        last token and the ``draft`` tokens, writing their keys and values into its blocks
        (which hold ``num_tokens + len(draft)`` slots), and return ``(n_accepted,
        next_token)`` by the acceptance rule. Slots past the accepted tokens hold stale keys
        until a later step writes over them: the computed tokens advance only past what was
        accepted."""
        seq = chunk.seq
        span = ScheduledChunk(seq, seq.num_tokens - 1, 1 + len(draft))
        (prefill,) = self._prefill_chunks([span], offset=0)
        tokens = torch.tensor([seq.token_ids[-1], *draft.tokens], dtype=torch.long, device=self.device)
        positions = torch.arange(span.start, span.start + span.num_tokens, device=self.device)
        attention = PagedAttention(self.pool, prefill.slots[span.start :], [], [prefill], backend=self.attention)
        hidden = self.model.hidden_states(tokens[None], positions[None], attention)[0]
        return accept(self.model.logits(hidden).float(), draft, seq.params, seq.generator)

    def flatten(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's tokens side by side, their positions, and the pool slot each one's key
        and value go to (``block_table[p // block_size] * block_size + p % block_size``)."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bs = self.pool.block_size
        for c in chunks:
            span = range(c.start, c.start + c.num_tokens)
            tokens += c.seq.token_ids[c.start : c.start + c.num_tokens]
            positions += span
            table = c.seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in span]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(tokens), as_tensor(positions), as_tensor(slots)

    def decode_groups(self, decodes: list[ScheduledChunk], group_size: int | None = None) -> list[DecodeGroup]:
        """Decodes (already sorted by length) in groups of ``group_size`` (default
        ``DECODE_GROUP``), each with its block tables padded to the group's longest (with
        block 0, masked out by length)."""
        size = group_size or DECODE_GROUP
        bs = self.pool.block_size
        groups = []
        for start in range(0, len(decodes), size):
            members = decodes[start : start + size]
            lengths = [c.start + 1 for c in members]
            width = -(-max(lengths) // bs)
            tables = [c.seq.block_table[:width] for c in members]
            blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=self.device)
            length_t = torch.tensor(lengths, device=self.device)
            mask = torch.arange(width * bs, device=self.device)[None, :] < length_t[:, None]
            groups.append(
                DecodeGroup(start, start + len(members), width, blocks.flatten(), mask[:, None, None, :], length_t)
            )
        return groups

    def _prefill_chunks(self, prefills: list[ScheduledChunk], offset: int) -> list[PrefillChunk]:
        bs = self.pool.block_size
        chunks = []
        for c in prefills:
            end = c.start + c.num_tokens
            blocks = torch.tensor(c.seq.block_table[: (end + bs - 1) // bs], dtype=torch.long, device=self.device)
            slots = (blocks[:, None] * bs + torch.arange(bs, device=self.device)).flatten()[:end]
            chunks.append(PrefillChunk(offset, c.num_tokens, slots))
            offset += c.num_tokens
        return chunks


def _choose(seqs: list[Sequence], logits: torch.Tensor, greedy: torch.Tensor | None = None) -> list[ChunkOutput]:
    """One token per row of ``logits`` for ``seqs``, with its logprobs where asked.

    ``greedy``, the rows' argmax when the step computed it already, answers a batch of greedy
    rows that change nothing. Rows whose requests adjust their logits (penalties, biases,
    ``min_tokens``) are adjusted, and rows held to a schema masked, in place, before the
    sampler sees them; logprobs are read from copies of the raw rows taken first.
    """
    params = [s.params for s in seqs]
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw = logits[asking] if asking else None  # a copy: shaping below changes logits
    shaped = _shape_logits_(seqs, logits)
    if greedy is not None and not shaped and all(p.greedy for p in params):
        tokens = greedy
    else:
        tokens = sample(logits, params, [s.generator for s in seqs])
    outputs = [ChunkOutput([token]) for token in tokens.tolist()]
    if asking:
        scored = token_logprobs(raw, tokens[asking], [params[i].logprobs for i in asking])
        for i, lp in zip(asking, scored):
            outputs[i].logprobs = [lp]
    return outputs


def _shape_logits_(seqs: list[Sequence], logits: torch.Tensor) -> bool:
    """Make ``logits`` what the sampler must see, in place: the rows whose requests adjust
    them (:mod:`minillm.decoding.penalties`) adjusted, then the rows held to a grammar masked
    (:mod:`minillm.decoding.structured`). Returns whether any row changed; with none, nothing ran, so
    the other requests pay nothing."""
    adjusting = [i for i, s in enumerate(seqs) if s.params.adjusts]
    constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if adjusting:
        picked = [seqs[i] for i in adjusting]
        adjust_logits_(logits, adjusting, [s.params for s in picked], [s.token_ids[: s.prompt_len] for s in picked],
                       [s.output_ids for s in picked], [s.eos_token_id for s in picked])
    if constrained:
        bias = token_bias([seqs[i].grammar for i in constrained], logits.shape[1], logits.device)
        mask_logits_(logits, constrained, bias)
    return bool(adjusting or constrained)


def _cumulative_ends(chunks: list[ScheduledChunk]) -> list[int]:
    ends, total = [], 0
    for c in chunks:
        total += c.num_tokens
        ends.append(total)
    return ends
