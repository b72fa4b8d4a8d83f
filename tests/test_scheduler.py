"""The scheduler, driven by a fake model: limits hold at every step, blocks never leak, the
keys and values a chunk reads are always its own, and every request finishes with exactly the
tokens it would have got running alone, however often it was chunked or preempted."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.engine.block_allocator import BlockAllocator
from minillm.engine.scheduler import RequestRejected, Scheduler, SchedulerOutput
from minillm.engine.sequence import Sequence, SequenceStatus
from minillm.decoding.sampling import FinishReason, SamplingParams

EOS = 0


def next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of the whole context, like greedy decoding."""
    return random.Random(hash(tuple(tokens))).randrange(8)  # EOS = 0 comes up 1 time in 8


def reference_output(prompt: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """What a request generates alone, with no cache, no batching and no preemption."""
    seq = Sequence("ref", prompt, params, max_model_len, EOS)
    while not seq.is_finished:
        seq.append_token(next_token(seq.token_ids), 0.0)
    return seq.output_ids


class Sim:
    """An engine in miniature: schedule, "run" each chunk against a fake KV store (checking
    the cache holds this sequence's own prefix), sample, postprocess; checking invariants."""

    def __init__(self, *, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                 max_model_len=64, chunked=True, caching=True) -> None:
        self.alloc = BlockAllocator(num_blocks, block_size, caching)
        self.sched = Scheduler(self.alloc, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                               max_model_len=max_model_len, enable_chunked_prefill=chunked)
        self.kv: dict[int, tuple[int, ...]] = {}
        self.added: list[Sequence] = []
        self.first_admitted: list[Sequence] = []
        self.now = 0.0

    def add(self, rid: str, prompt: list[int], **params) -> Sequence:
        seq = Sequence(rid, prompt, SamplingParams(**params), self.sched.max_model_len, EOS, self.now)
        self.sched.add(seq)
        self.added.append(seq)
        return seq

    def slot(self, seq: Sequence, p: int) -> int:
        bs = self.alloc.block_size
        return seq.block_table[p // bs] * bs + p % bs

    def run_chunk(self, chunk) -> None:
        seq, bs = chunk.seq, self.alloc.block_size
        assert chunk.start + chunk.num_tokens == seq.num_computed_tokens and chunk.num_tokens >= 1  # counted at scheduling
        assert chunk.start + chunk.num_tokens <= seq.num_tokens
        assert len(seq.block_table) * bs >= chunk.start + chunk.num_tokens  # every slot is backed
        for p in range(chunk.start):  # attention reads the cached prefix: it must be ours
            assert self.kv[self.slot(seq, p)] == tuple(seq.token_ids[: p + 1])
        for p in range(chunk.start, chunk.start + chunk.num_tokens):
            assert self.alloc.ref_counts[seq.block_table[p // bs]] == 1  # never write a shared block
            self.kv[self.slot(seq, p)] = tuple(seq.token_ids[: p + 1])
        if chunk.samples:
            seq.append_token(next_token(seq.token_ids), self.now)

    def step(self) -> SchedulerOutput:
        self.now += 1.0
        was_admitted = {id(s) for s in self.first_admitted}
        out = self.sched.schedule(self.now)
        self.check_step(out)
        self.first_admitted += [c.seq for c in out.chunks if id(c.seq) not in was_admitted]
        for chunk in out.chunks:
            self.run_chunk(chunk)
        finished = self.sched.postprocess(out)
        assert all(s.is_finished and not s.block_table for s in finished)
        self.check_blocks()
        return out

    def check_step(self, out: SchedulerOutput) -> None:
        s = self.sched
        seqs = [c.seq for c in out.chunks]
        assert len(s.running) <= s.max_num_seqs
        assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks) <= s.max_num_batched_tokens
        assert len(set(map(id, seqs))) == len(seqs)
        assert not set(map(id, seqs)) & set(map(id, out.preempted))
        assert all(seq.status is SequenceStatus.RUNNING for seq in seqs)
        assert all(p.status is SequenceStatus.PREEMPTED and p.num_computed_tokens == 0 for p in out.preempted)
        assert out.chunks or not s.has_unfinished  # progress: a step with work never idles
        if not s.enable_chunked_prefill:  # partial prefills only for recomputes that never fit
            assert all(c.samples or c.seq.num_tokens > s.max_num_batched_tokens for c in out.chunks)

    def check_blocks(self) -> None:
        held: dict[int, int] = {}
        for seq in self.sched.running:
            assert len(set(seq.block_table)) == len(seq.block_table)
            for b in seq.block_table:
                held[b] = held.get(b, 0) + 1
        assert all(not seq.block_table for seq in self.sched.waiting)
        assert all(self.alloc.ref_counts[b] == held.get(b, 0) for b in range(self.alloc.num_blocks))
        free = set(self.alloc.free_list) | set(self.alloc.evictable)
        assert not free & held.keys() and len(free) + len(held) == self.alloc.num_blocks

    def check_fcfs(self) -> None:
        """Requests are first admitted in arrival order (aborted-while-waiting ones drop out)."""
        order = [s for s in self.added if s.first_scheduled_time is not None]
        assert [s.request_id for s in self.first_admitted] == [s.request_id for s in order]

    def check_outputs(self, aborted: set[str]) -> None:
        for seq in self.added:
            want = reference_output(seq.token_ids[: seq.prompt_len], seq.params, self.sched.max_model_len)
            assert seq.is_finished
            if seq.request_id in aborted:
                assert seq.finish_reason is FinishReason.ABORT and want[: seq.num_output_tokens] == seq.output_ids
            else:
                assert seq.output_ids == want and seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


request = st.tuples(st.integers(0, 4), st.integers(1, 24), st.integers(1, 20), st.booleans(), st.integers(0, 3))
config = st.fixed_dictionaries({
    "num_blocks": st.integers(3, 12), "block_size": st.integers(2, 6), "max_num_seqs": st.integers(1, 8),
    "max_num_batched_tokens": st.integers(1, 48), "max_model_len": st.integers(8, 32),
    "chunked": st.booleans(), "caching": st.booleans(),
})


@settings(max_examples=150, deadline=None)
@given(config, st.lists(request, min_size=1, max_size=12), st.lists(st.integers(0, 60), max_size=3))
def test_random_workloads_keep_every_invariant(config, requests, aborts):
    """Arrivals over time, shared prompt stems, aborts, tiny pools: the scheduler may refuse a
    request only for a stated reason, and everything else finishes correctly, leaving no block."""
    sim, aborted = Sim(**config), set()
    stem = [3, 1, 4, 1, 5, 9, 2, 6] * 5
    for step in range(2000):
        for i, (arrive, n, max_tokens, ignore_eos, extra) in enumerate(requests):
            if arrive == step:
                try:
                    sim.add(str(i), stem[:n] + [7] * extra, max_tokens=max_tokens, ignore_eos=ignore_eos)
                except RequestRejected as e:
                    assert expected_rejection(sim.sched, n + extra, max_tokens) in str(e)
        for k, at in enumerate(aborts):
            if at == step and sim.sched.abort(str(k), sim.now) is not None:
                aborted.add(str(k))
        if step > 6 and not sim.sched.has_unfinished:
            break
        sim.step()
    assert not sim.sched.has_unfinished  # every request finished in bounded time
    assert sim.alloc.num_free_blocks == sim.alloc.num_blocks
    sim.check_fcfs()
    sim.check_outputs(aborted)


def expected_rejection(s: Scheduler, prompt_len: int, max_tokens: int) -> str:
    if prompt_len >= s.max_model_len:
        return f"max_model_len is {s.max_model_len}"
    if not s.enable_chunked_prefill and prompt_len > s.max_num_batched_tokens:
        return f"max_num_batched_tokens={s.max_num_batched_tokens}"
    return f"num_blocks={s.allocator.num_blocks}"


def run_to_end(sim: Sim, limit: int = 500) -> None:
    for _ in range(limit):
        if not sim.sched.has_unfinished:
            return
        sim.step()
    raise AssertionError("requests did not finish")


def test_preemption_recomputes_and_gives_the_same_tokens():
    prompts = [[i + 1] * 6 + [9, 8, 7] for i in range(4)]
    runs = {}
    for num_blocks in (64, 6):  # plenty, then too few for all four to grow at once
        sim = Sim(num_blocks=num_blocks, block_size=4, max_model_len=64)
        seqs = [sim.add(str(i), p, max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)]
        run_to_end(sim)
        runs[num_blocks] = ([s.output_ids for s in seqs], sim.sched.num_preemptions)
    assert runs[64][1] == 0 and runs[6][1] > 0
    assert runs[6][0] == runs[64][0] and all(len(o) == 12 for o in runs[6][0])


def test_the_newest_is_preempted_and_requeued_first_with_its_cache_kept():
    sim = Sim(num_blocks=4, block_size=4, max_model_len=64)
    old = sim.add("old", [1] * 7, max_tokens=5, ignore_eos=True)  # up to 12 tokens: 3 blocks
    new = sim.add("new", [2] * 7, max_tokens=5, ignore_eos=True)
    late = sim.add("late", [3] * 3, max_tokens=2)
    while not new.num_preemptions:
        out = sim.step()
    assert out.preempted == [new] and old.status is SequenceStatus.RUNNING
    assert list(sim.sched.waiting) == [new, late] and sim.sched.num_preemptions == 1
    while new.status is not SequenceStatus.RUNNING:
        sim.step()
    assert new.num_cached_prompt_tokens > 0  # its full blocks were still in the prefix cache
    run_to_end(sim)


def test_a_running_sequence_that_cannot_grow_preempts_itself_if_newest():
    sim = Sim(num_blocks=3, block_size=2, max_model_len=64, caching=False)
    first = sim.add("a", [1], max_tokens=4, ignore_eos=True)
    second = sim.add("b", [2], max_tokens=3, ignore_eos=True)
    sim.step()  # both admitted, one block each
    sim.step()  # both fill their block
    out = sim.step()  # a takes the last block; b, itself the newest, must go
    assert out.preempted == [second] and [c.seq for c in out.chunks] == [first]
    run_to_end(sim)
    assert first.num_output_tokens == 4 and second.num_output_tokens == 3


def test_chunked_prefill_splits_a_long_prompt_and_samples_once():
    sim = Sim(max_num_batched_tokens=8, caching=False)
    seq = sim.add("a", list(range(1, 21)), max_tokens=2, ignore_eos=True)
    sizes = []
    while not seq.is_finished:
        (chunk,) = sim.step().chunks
        sizes.append((chunk.num_tokens, chunk.samples))
    assert sizes == [(8, False), (8, False), (4, True), (1, True)]


def test_without_chunked_prefill_prompts_run_whole_and_in_order():
    sim = Sim(max_num_batched_tokens=10, chunked=False, caching=False)
    a = sim.add("a", [1] * 6, max_tokens=5, ignore_eos=True)
    b = sim.add("b", [2] * 9, max_tokens=1)
    c = sim.add("c", [3] * 2, max_tokens=1)
    assert [(ch.seq, ch.num_tokens) for ch in sim.step().chunks] == [(a, 6)]  # b does not fit, c waits
    assert [(ch.seq, ch.num_tokens) for ch in sim.step().chunks] == [(a, 1), (b, 9)]
    assert c.status is SequenceStatus.WAITING
    run_to_end(sim)


def test_without_chunked_prefill_a_recompute_too_big_for_a_step_goes_in_pieces():
    sim = Sim(num_blocks=7, block_size=2, max_num_batched_tokens=8, chunked=False, caching=False)
    sim.add("a", [1], max_tokens=12, ignore_eos=True)
    b = sim.add("b", [2] * 6, max_tokens=6, ignore_eos=True)  # preempted once it has 10 tokens
    pieces = []
    while sim.sched.has_unfinished:
        pieces += [c.num_tokens for c in sim.step().chunks if c.seq is b and not c.samples]
    assert b.num_preemptions > 0 and pieces and b.num_output_tokens == 6


def test_limits_on_sequences_and_tokens():
    sim = Sim(max_num_seqs=2, max_num_batched_tokens=5, caching=False)
    for i in range(4):
        sim.add(str(i), [i + 1] * 3, max_tokens=4, ignore_eos=True)
    out = sim.step()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("0", 3), ("1", 2)]
    assert len(sim.sched.running) == 2 and sim.sched.num_waiting == 2
    run_to_end(sim)


def test_shared_prompts_hit_the_prefix_cache():
    sim = Sim(block_size=16, num_blocks=16, max_num_batched_tokens=64, max_model_len=128)
    prompt = list(range(1, 41))
    sim.add("1", prompt, max_tokens=1)
    sim.step()
    second = sim.add("2", prompt, max_tokens=1)
    (chunk,) = sim.step().chunks
    assert (chunk.start, chunk.num_tokens, second.num_cached_prompt_tokens) == (32, 8, 32)
    assert sim.alloc.prefix_hit_rate == 32 / 80  # what the engine's stats report


@pytest.mark.parametrize(
    "prompt_len, max_tokens, chunked, words",
    [
        (0, 4, True, "empty"),
        (16, 4, True, "max_model_len is 16"),
        (20, 4, True, "max_model_len is 16"),
        (10, 4, False, "max_num_batched_tokens=8"),
        (10, 30, True, "num_blocks=3"),
    ],
)
def test_requests_that_could_never_run_are_refused(prompt_len, max_tokens, chunked, words):
    sim = Sim(num_blocks=3, block_size=4, max_num_batched_tokens=8, max_model_len=16, chunked=chunked)
    with pytest.raises(RequestRejected, match=words):
        sim.add("x", [1] * prompt_len, max_tokens=max_tokens)
    assert not sim.sched.has_unfinished


def test_the_largest_acceptable_request_runs():
    sim = Sim(num_blocks=3, block_size=4, max_num_batched_tokens=8, max_model_len=16)
    seq = sim.add("x", [1] * 10, max_tokens=2, ignore_eos=True)  # 12 tokens: exactly 3 blocks
    run_to_end(sim)
    assert seq.finish_reason is FinishReason.LENGTH
    sim.add("y", [1], max_tokens=1)
    with pytest.raises(RequestRejected, match="already in use"):
        sim.add("y", [1], max_tokens=1)


def test_abort_frees_blocks_waiting_running_or_mid_step():
    sim = Sim(max_num_seqs=1)
    running = sim.add("r", [1] * 9, max_tokens=10, ignore_eos=True)
    waiting = sim.add("w", [2] * 5, max_tokens=10)
    sim.step()
    assert sim.sched.abort("w", sim.now) is waiting and waiting.finish_reason is FinishReason.ABORT
    out = sim.sched.schedule(sim.now)
    assert sim.sched.abort("r", sim.now) is running  # while its step runs
    assert running.block_table  # that step may still write them: kept until it is accounted for
    assert sim.sched.postprocess(out) == [] and not running.block_table
    assert sim.sched.abort("r", sim.now) is None and sim.sched.abort("nobody", sim.now) is None
    assert not sim.sched.has_unfinished and sim.alloc.num_free_blocks == sim.alloc.num_blocks


def test_append_token_finishes_on_stop_and_length():
    def seq(**params) -> Sequence:
        return Sequence("s", [5, 6], SamplingParams(**params), max_model_len=5, eos_token_id=EOS)

    prompt = [5, 6]
    s = Sequence("s", prompt, SamplingParams(max_tokens=2), max_model_len=5, eos_token_id=EOS)
    s.append_token(4, 1.0)
    assert (s.prompt_len, s.output_ids, prompt) == (2, [4], [5, 6])  # made from a copy of its prompt
    s.append_token(EOS, 2.0)  # the end-of-text token and the last allowed one: a stop wins
    assert (s.finish_reason, s.output_ids, s.token_times) == (FinishReason.STOP, [4, EOS], [1.0, 2.0])
    assert (s.first_token_time, s.finish_time) == (1.0, 2.0)
    with pytest.raises(RuntimeError):
        s.append_token(1, 3.0)
    s = seq(max_tokens=3, ignore_eos=True, stop_token_ids=[9])
    s.append_token(EOS, 1.0)
    s.append_token(9, 2.0)
    assert s.finish_reason is FinishReason.STOP
    s = seq(max_tokens=2)
    s.append_token(1, 1.0)
    assert not s.is_finished
    s.append_token(2, 2.0)
    assert s.finish_reason is FinishReason.LENGTH
    s = seq(max_tokens=10)
    for t in (1, 2, 3):
        s.append_token(t, 1.0)
    assert s.finish_reason is FinishReason.LENGTH and s.num_tokens == 5  # the context is full
