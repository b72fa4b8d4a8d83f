"""The model runner: turns the scheduler's decision for one step into tensors and tokens.

For each scheduled chunk (a sequence and a run of its tokens to compute) it lays the tokens
out flat, with their positions and the pool slots their keys and values go to, builds the
block tables the attention reads through, runs the *same* ``GPT`` the training chapter built,
once, and samples a token for every chunk that reaches the end of its sequence. The LM head,
a ``d_model x 50,257`` matmul per token, runs only on those rows: a 200-token prompt pays for
it once, not 200 times.
"""

from __future__ import annotations

import torch

from minillm.engine.kv_cache import DecodeGroup, PagedAttention, PagedKVPool, PrefillChunk
from minillm.engine.scheduler import ScheduledChunk, SchedulerOutput
from minillm.model import GPT
from minillm.sampling import make_generator, sample
from minillm.speculative import Draft, accept


# Decodes attended together in one call. Larger groups mean fewer calls but more padding
# (every member is padded to the longest); 16 length-sorted sequences keep both small.
DECODE_GROUP = 16


class ModelRunner:
    """Owns the model and the KV pool's storage; knows nothing about who is waiting."""

    def __init__(self, model: GPT, pool: PagedKVPool, attention: str = "torch") -> None:
        self.model, self.pool = model, pool
        self.attention = attention  # "torch" or "triton": see PagedAttention
        self.device = model.tok_emb.weight.device
        self._generators: dict[str, torch.Generator | None] = {}

    def forget(self, request_id: str) -> None:
        """Drop a finished request's random generator."""
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> list[int | None]:
        """Run one step; returns, per chunk in ``output.chunks`` order, the sampled token, or
        ``None`` for a chunk that does not reach its sequence's end (a partial prefill)."""
        decodes = sorted((c for c in output.chunks if c.num_tokens == 1), key=lambda c: c.start)
        prefills = [c for c in output.chunks if c.num_tokens > 1]
        ordered = decodes + prefills
        tokens, positions, slots = self._flatten(ordered)
        attention = PagedAttention(
            self.pool, slots, self._decode_groups(decodes), self._prefill_chunks(prefills, offset=len(decodes)),
            backend=self.attention,
        )
        hidden = self.model.hidden_states(tokens[None], positions[None], attention)[0]
        ends = torch.tensor(_cumulative_ends(ordered), device=self.device)
        wanted = [i for i, c in enumerate(ordered) if c.samples]
        sampled: dict[int, int] = {}
        if wanted:
            logits = self.model.logits(hidden[ends[wanted] - 1]).float()
            params = [ordered[i].seq.params for i in wanted]
            generators = [self.generator(ordered[i]) for i in wanted]
            for i, token in zip(wanted, sample(logits, params, generators).tolist()):
                sampled[id(ordered[i])] = token
        return [sampled.get(id(c)) for c in output.chunks]

    @torch.inference_mode()
    def verify(self, chunk: ScheduledChunk, draft: Draft, generator: torch.Generator | None) -> tuple[int, int]:
        """Speculative decoding's check (chapter 12): run the target once over the sequence's
        last token and the ``draft`` tokens, writing their keys and values into its blocks
        (which must already hold ``num_tokens + len(draft)`` slots), and return
        ``(n_accepted, next_token)`` by the acceptance rule. Slots past the accepted tokens hold
        stale keys until the next step writes over them: the caller advances the computed
        tokens only past what was accepted."""
        seq = chunk.seq
        span = ScheduledChunk(seq, seq.num_tokens - 1, 1 + len(draft))
        (prefill,) = self._prefill_chunks([span], offset=0)
        tokens = torch.tensor([seq.token_ids[-1], *draft.tokens], dtype=torch.long, device=self.device)
        positions = torch.arange(span.start, span.start + span.num_tokens, device=self.device)
        attention = PagedAttention(self.pool, prefill.slots[span.start :], [], [prefill], backend=self.attention)
        hidden = self.model.hidden_states(tokens[None], positions[None], attention)[0]
        return accept(self.model.logits(hidden).float(), draft, seq.params, generator)

    def _flatten(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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

    def _decode_groups(self, decodes: list[ScheduledChunk]) -> list[DecodeGroup]:
        """Decodes (already sorted by length) in groups of ``DECODE_GROUP``, each with its
        block tables padded to the group's longest (with block 0, masked out by length)."""
        bs = self.pool.block_size
        groups = []
        for start in range(0, len(decodes), DECODE_GROUP):
            members = decodes[start : start + DECODE_GROUP]
            lengths = torch.tensor([c.start + 1 for c in members], device=self.device)
            width = (int(lengths.max()) + bs - 1) // bs
            tables = [c.seq.block_table[:width] for c in members]
            blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=self.device)
            mask = torch.arange(width * bs, device=self.device)[None, :] < lengths[:, None]
            groups.append(
                DecodeGroup(start, start + len(members), width, blocks.flatten(), mask[:, None, None, :], lengths)
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

    def generator(self, chunk: ScheduledChunk) -> torch.Generator | None:
        """The request's own random generator, made on its first sampled token."""
        rid = chunk.seq.request_id
        if rid not in self._generators:
            self._generators[rid] = make_generator(chunk.seq.params, self.device)
        return self._generators[rid]


def _cumulative_ends(chunks: list[ScheduledChunk]) -> list[int]:
    ends, total = [], 0
    for c in chunks:
        total += c.num_tokens
        ends.append(total)
    return ends
