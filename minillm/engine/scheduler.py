"""Who runs this step: the ``Scheduler``.

Continuous batching (chapter 7) decides afresh at every step which sequences go through the
model; paging (chapter 8) adds KV blocks to compute as a resource. Each step builds one batch
under ``max_num_seqs``, ``max_num_batched_tokens`` and the pool's free blocks, as vLLM does:

1. Running sequences first, oldest first, one chunk each (a decode, or the next piece of a
   chunked prefill). When the pool runs dry the *newest* running sequence is preempted: its
   blocks are freed and it waits at the front of the queue, to be recomputed over prompt +
   output so far (a prefill is one efficient matmul, and the prefix cache gives much back).
2. Then, unless someone was preempted (admitting more would only thrash), waiting sequences
   in arrival order while the limits allow; prefix-cache hits cost no budget. The first that
   does not fit stops admission: nobody overtakes it, so nobody starves.
3. With speculative decoding, decodes also get lookahead slots for their drafts, as many as
   the speculator's policy asks for each (:meth:`Scheduler.reserve_lookahead`), so the
   scheduler stays the only one handing out blocks.
4. An engine with several steps in flight (pipeline micro-batches, chapter 17) names the
   sequences still in one (``busy``): neither scheduled again nor preempted.

Scheduling a chunk counts its positions as computed and its sampled token as pending (see
:mod:`~minillm.engine.sequence`), so the next step can be scheduled before this one has run:
an overlapped engine schedules step N+1 while step N computes. A sequence with a step in flight
is never preempted, and its blocks are freed only once every step that holds it is accounted for.

A request that could never run is refused at :meth:`Scheduler.add`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field

from minillm.decoding.sampling import FinishReason
from minillm.engine.block_allocator import BlockAllocator
from minillm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    """Compute K/V for ``seq.token_ids[start : start + num_tokens]``.

    ``samples``: the chunk ends at the sequence's last token, so its logits give the next one
    (fixed when the chunk is made, so it stays right after the engine appends).
    ``num_lookahead``: slots reserved past the end for speculative decoding's draft tokens.
    """

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool = field(init=False)
    num_lookahead: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.seq.num_tokens

    def input_tokens(self) -> list[int]:
        """The tokens this chunk feeds: the sequence's, from ``start`` (a chunk that feeds
        tokens past the sequence's end, a speculative draft, says which)."""
        return self.seq.token_ids[self.start : self.start + self.num_tokens]

    @property
    def is_decode(self) -> bool:
        """One new token after a finished prompt: the step that generates."""
        return self.num_tokens == 1 and self.samples and self.start >= self.seq.prompt_len


@dataclass
class SchedulerOutput:
    """One step's batch: the chunks to run, and who was preempted to make room for them."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0  # the sum of the chunks' sizes

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self.num_batched_tokens += chunk.num_tokens


class RequestRejected(ValueError):
    """A request that can never be served, refused on arrival rather than queued forever."""


class Scheduler:
    """Admission, the token budget and preemption by recompute, over one ``BlockAllocator``.
    ``waiting`` is FCFS (the preempted re-enter at the front); ``running`` is in admission
    order, so its last element is the newest, the first to be preempted."""

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        num_lookahead_slots: int = 0,
    ) -> None:
        if min(max_num_seqs, max_num_batched_tokens, max_model_len) < 1:
            raise ValueError(
                "max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1, got "
                f"{max_num_seqs}, {max_num_batched_tokens}, {max_model_len}"
            )
        if num_lookahead_slots < 0:
            raise ValueError(f"num_lookahead_slots must be >= 0, got {num_lookahead_slots}")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.num_lookahead_slots = num_lookahead_slots
        # the lookahead slots each of a step's decoding sequences asks for, given the step's number
        # of chunks (asked once a step; each is capped at num_lookahead_slots)
        self.lookahead: Callable[[int, list[Sequence]], list[int]] = \
            lambda batch, seqs: [self.num_lookahead_slots] * len(seqs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._busy: Collection[Sequence] = ()  # this step's sequences still in an earlier step
        self._max_seqs = max_num_seqs  # this step's most chunks
        self._requests: dict[Hashable, Sequence] = {}  # unfinished requests by id, for abort

    # ------------------------------------------------------------------ arrival

    def add(self, seq: Sequence) -> None:
        """Queue a new request, or raise :class:`RequestRejected` saying why it can never run."""
        reason = self._rejection(seq)
        if reason is not None:
            raise RequestRejected(f"request {seq.request_id!r} rejected: {reason}")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._requests[seq.request_id] = seq

    def _rejection(self, seq: Sequence) -> str | None:
        """Why ``seq`` could never run, or None. Each check guards a way to wait forever."""
        p, limit, bs = seq.prompt_len, self.max_model_len, self.allocator.block_size
        if seq.request_id in self._requests:
            return "this request id is already in use"
        if p == 0:
            return "the prompt is empty; a request needs at least one token"
        if p >= limit:
            return f"the prompt has {p} tokens but max_model_len is {limit}, leaving no room to generate"
        if not self.enable_chunked_prefill and p > self.max_num_batched_tokens:
            return (
                f"the prompt has {p} tokens, more than max_num_batched_tokens={self.max_num_batched_tokens}, "
                "and chunked prefill is off"
            )
        total = min(p + seq.params.max_tokens, limit)
        need = self.allocator.blocks_for(total)
        if need > self.allocator.num_blocks:
            return (
                f"up to {total} tokens (prompt + max_tokens, at most max_model_len={limit}) need {need} "
                f"KV blocks of {bs} tokens, but the pool holds only num_blocks={self.allocator.num_blocks}"
            )
        return None

    # ------------------------------------------------------------------ one step

    def schedule(self, now: float, busy: Collection[Sequence] = (), max_seqs: int | None = None) -> SchedulerOutput:
        """Choose this step's chunks: running sequences first, then admissions (see the module
        docstring). Blocks for every chunk are allocated before it is returned.

        An engine with earlier steps still in flight passes their sequences as ``busy``, which
        are neither scheduled nor preempted, and may cap this step at ``max_seqs`` chunks."""
        out = SchedulerOutput()
        self._busy, self._max_seqs = busy, max_seqs or self.max_num_seqs
        self.schedule_running(out)
        if not out.preempted:
            self.admit_waiting(out, now)
        if self.num_lookahead_slots:
            self.reserve_lookahead(out)
        for chunk in out.chunks:
            self.launched(chunk)
        return out

    @staticmethod
    def launched(chunk: ScheduledChunk) -> None:
        """Count a scheduled chunk as run: its positions computed, its token (if it samples)
        pending, and one more step holding the sequence."""
        seq = chunk.seq
        seq.num_computed_tokens = chunk.start + chunk.num_tokens
        seq.num_pending += chunk.samples
        seq.num_steps_in_flight += 1

    def abandon(self, output: SchedulerOutput) -> None:
        """Undo :meth:`launched` for a step that failed before it was accounted for: its
        sequences are as they were before it was scheduled (the blocks it took stay theirs)."""
        for chunk in reversed(output.chunks):
            seq = chunk.seq
            seq.num_steps_in_flight -= 1
            if seq.is_finished:
                self._release_if_idle(seq)
                continue
            seq.num_computed_tokens = chunk.start
            seq.num_pending -= chunk.samples

    def reserve_lookahead(self, out: SchedulerOutput) -> None:
        """Room for draft tokens after each decode, as many as ``lookahead`` asks for it in a
        step of this size (a speculator turns drafting down as the batch grows, where it stops
        paying), cut to what the request can still use, and from free blocks only: no one is
        preempted for a draft."""
        # a row whose logits are adjusted or reported at every position decodes token by token
        drafting = [c for c in out.chunks if c.is_decode and not c.seq.params.token_by_token]
        if not drafting:
            return
        for chunk, wanted in zip(drafting, self.lookahead(len(out.chunks), [c.seq for c in drafting])):
            seq = chunk.seq
            room = min(wanted, self.num_lookahead_slots,
                       seq.params.max_tokens - seq.num_output_tokens - seq.num_pending - 1, self.max_model_len - seq.num_tokens - 1)
            if room > 0 and self.allocator.can_allocate(seq, seq.num_tokens + room):
                self.allocator.grow(seq, seq.num_tokens + room)
                chunk.num_lookahead = room

    def _budget_left(self, out: SchedulerOutput) -> int:
        return self.max_num_batched_tokens - out.num_batched_tokens

    def schedule_running(self, out: SchedulerOutput) -> None:
        """One chunk per running sequence not ``busy``, oldest first, while the token budget
        lasts. Preemption takes sequences from the end of ``running``, which this loop has not
        reached yet, so no scheduled chunk ever loses its blocks."""
        busy, limit = self._busy, self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and (budget := limit - out.num_batched_tokens) > 0 and len(out.chunks) < self._max_seqs:
            seq = self.running[i]
            i += 1
            if seq in busy or seq.awaits_last_token:
                continue
            start = seq.num_computed_tokens
            end = min(seq.num_tokens, start + budget)
            if not self.make_room(seq, end, out):
                break  # seq itself was the newest and is now preempted: nobody after it
            out.add(ScheduledChunk(seq, start, end - start))

    def make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Give ``seq`` blocks for ``num_tokens`` tokens, preempting the newest running
        sequences until it fits. False if ``seq`` itself had to go, or could not get room
        because every sequence left has a step in flight."""
        if self.allocator.blocks_for(num_tokens) <= len(seq.block_table):
            return True  # its last block has room: most decode steps
        while not self.allocator.can_allocate(seq, num_tokens):
            victim = self.newest_preemptible()  # seq itself, at the latest, unless it is in flight
            if victim is None:
                return False
            self.preempt(victim, out)
            if victim is seq:
                return False
        self.allocator.grow(seq, num_tokens)
        return True

    def newest_preemptible(self) -> Sequence | None:
        """The newest running sequence with no step in flight (an earlier micro-batch, or the
        step an overlapped engine is computing, may still write its blocks): the next to preempt."""
        return next((s for s in reversed(self.running) if not s.num_steps_in_flight), None)

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take back all of ``seq``'s blocks and queue it first, to recompute later. Its
        tokens are kept, so the recompute is simply a prefill of prompt + output so far (its
        full blocks stay in the prefix cache until evicted, so it may get many back)."""
        self.running.remove(seq)
        self.allocator.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def admit_waiting(self, out: SchedulerOutput, now: float) -> None:
        """Admit waiting sequences in order until the first that does not fit."""
        while (self.waiting and len(self.running) < self.max_num_seqs and self._budget_left(out) > 0
               and len(out.chunks) < self._max_seqs):
            seq = self.waiting[0]
            # A prompt being scored must run through the model: cached blocks have no logits.
            shared = [] if seq.scoring_prompt else self.allocator.match_prefix(seq)
            start = len(shared) * self.allocator.block_size
            num_tokens = self.first_chunk_size(seq.num_tokens - start, self._budget_left(out))
            if num_tokens == 0 or not self.allocator.can_allocate(seq, start + num_tokens, shared):
                return
            self.waiting.popleft()
            self.allocator.admit(seq, start + num_tokens, shared)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            out.add(ScheduledChunk(seq, start, num_tokens))

    def first_chunk_size(self, to_compute: int, budget: int) -> int:
        """Tokens to compute at admission, or 0 if the sequence must wait for a later step.

        Without chunked prefill a prefill runs whole, except one that could never fit in a
        step: a preempted sequence whose prompt + output outgrew the budget. It is recomputed
        in pieces rather than starved (a new prompt that large was refused at ``add``).
        """
        if to_compute <= budget:
            return to_compute
        if self.enable_chunked_prefill or to_compute > self.max_num_batched_tokens:
            return budget
        return 0

    # ------------------------------------------------------------------ after the model ran

    def postprocess(self, output: SchedulerOutput) -> list[Sequence]:
        """Account for a step the engine has run and appended: put the blocks it filled in the
        prefix cache, and retire (and return) the sequences it finished.

        A chunk that sampled leaves every token computed but the newest, the next step's input
        (accepted draft tokens included; rejected ones' slots are written over later). A
        finished sequence (this step's, or an earlier one's seen late, or aborted) gives its
        blocks back once no step in flight holds it.
        """
        finished = []
        commit = self.allocator.commit
        for chunk in output.chunks:
            seq = chunk.seq
            seq.num_steps_in_flight -= 1
            done = seq.status is SequenceStatus.FINISHED
            if seq.finish_reason is not FinishReason.ABORT:
                if chunk.samples and not done:
                    seq.num_computed_tokens = max(seq.num_computed_tokens, seq.num_tokens - 1)
                commit(seq, chunk.start + chunk.num_tokens)  # before freeing, so a finished prompt can still be hit
            if done:
                if self._requests.get(seq.request_id) is seq:
                    del self._requests[seq.request_id]
                    finished.append(seq)
                self._release_if_idle(seq)
        if finished:
            self.running = [s for s in self.running if s.status is not SequenceStatus.FINISHED]
        return finished

    def _release_if_idle(self, seq: Sequence) -> None:
        """Free a finished sequence's blocks, unless a step in flight may still write them."""
        if not seq.num_steps_in_flight:
            self.allocator.free(seq)

    def abort(self, request_id: Hashable, now: float) -> Sequence | None:
        """Finish a waiting or running request with ``"abort"`` and free its blocks; None if
        there is no such unfinished request (one just finished keeps its real reason)."""
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished:
            return None
        del self._requests[request_id]
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.finish(FinishReason.ABORT, now)
        self._release_if_idle(seq)
        return seq

    # ------------------------------------------------------------------ statistics

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def unfinished_request_ids(self) -> list[Hashable]:
        """Every waiting or running request's id, in arrival order."""
        return list(self._requests)

    @property
    def queued_request_ids(self) -> list[Hashable]:
        """The waiting requests that were never scheduled, in arrival order: nothing computed,
        nothing sent (a preempted request is waiting too, but its client has seen tokens)."""
        return [seq.request_id for seq in self.waiting if seq.status is SequenceStatus.WAITING]

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
