"""The block allocator: sizes, reference counts, the prefix cache, and (property-based) that
random allocations and frees never leak a block, never double-book one, and never let a
sequence read keys and values that are not its own."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.engine.block_allocator import BlockAllocator
from minillm.engine.sequence import Sequence
from minillm.decoding.sampling import SamplingParams


def make_seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=8), max_model_len=1024)


def admit_and_compute(alloc: BlockAllocator, seq: Sequence, upto: int | None = None) -> None:
    """Admit ``seq`` with its prefix hits, then pretend the model computed ``upto`` tokens."""
    shared = alloc.match_prefix(seq)
    upto = seq.num_tokens if upto is None else upto
    alloc.admit(seq, upto, shared)
    seq.num_computed_tokens = upto
    alloc.commit(seq)


def check_blocks(alloc: BlockAllocator, tables: list[list[int]]) -> None:
    """Every block is exactly one of: held (ref count = number of tables holding it), plain
    free, or evictable; no table lists a block twice."""
    held: dict[int, int] = {}
    for table in tables:
        assert len(set(table)) == len(table)
        for b in table:
            held[b] = held.get(b, 0) + 1
    for b in range(alloc.num_blocks):
        assert alloc.ref_counts[b] == held.get(b, 0)
    free, evictable = set(alloc.free_list), set(alloc.evictable)
    assert len(free) == len(alloc.free_list) and not free & evictable
    assert not (free | evictable) & held.keys()
    assert len(free) + len(evictable) + len(held) == alloc.num_blocks
    assert alloc.num_used_blocks == len(held)


def test_sizes_and_a_simple_lifecycle():
    alloc = BlockAllocator(num_blocks=8, block_size=16)
    assert [alloc.blocks_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    seq = make_seq(list(range(20)))
    alloc.admit(seq, 20, [])
    assert len(seq.block_table) == 2 and alloc.num_used_blocks == 2
    alloc.grow(seq, 33)  # crossing two block boundaries: one block each
    assert len(seq.block_table) == 3 and alloc.usage == 3 / 8
    check_blocks(alloc, [seq.block_table])
    alloc.free(seq)
    assert seq.block_table == [] and alloc.num_free_blocks == 8
    check_blocks(alloc, [])


def test_can_allocate_counts_only_missing_blocks():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    a, b = make_seq([1] * 12, "a"), make_seq([2] * 5, "b")
    alloc.admit(a, 12, [])  # 3 of 4 blocks
    assert alloc.can_allocate(b, 4) and not alloc.can_allocate(b, 5)
    assert alloc.can_allocate(a, 16) and not alloc.can_allocate(a, 17)


def test_same_40_token_prompt_shares_two_full_blocks():
    alloc = BlockAllocator(num_blocks=10, block_size=16)
    prompt = list(range(100, 140))
    first, second = make_seq(prompt, "1"), make_seq(prompt, "2")
    admit_and_compute(alloc, first)
    shared = alloc.match_prefix(second)
    assert shared == first.block_table[:2]
    alloc.admit(second, second.num_tokens, shared)
    assert second.num_computed_tokens == second.num_cached_prompt_tokens == 32
    assert [alloc.ref_counts[b] for b in shared] == [2, 2]
    assert second.block_table[2] != first.block_table[2]  # the partial block is never shared
    assert (alloc.prefix_queries, alloc.prefix_hits) == (80, 32)
    assert alloc.prefix_hit_rate == 32 / 80
    check_blocks(alloc, [first.block_table, second.block_table])


def test_a_fully_cached_prompt_still_computes_its_last_token():
    alloc = BlockAllocator(num_blocks=10, block_size=16)
    prompt = list(range(32))
    admit_and_compute(alloc, make_seq(prompt, "1"))
    again = make_seq(prompt, "2")
    assert len(alloc.match_prefix(again)) == 1  # 16 tokens, not 32
    alloc.admit(again, 32, alloc.match_prefix(again))
    assert again.num_computed_tokens == 16


def test_a_different_token_breaks_the_chain():
    alloc = BlockAllocator(num_blocks=10, block_size=4)
    admit_and_compute(alloc, make_seq(list(range(13)), "1"))
    changed = list(range(13))
    changed[5] = 99  # second block differs, so the third cannot match either
    assert len(alloc.match_prefix(make_seq(changed, "2"))) == 1


def test_freed_blocks_stay_cached_until_the_free_list_runs_out():
    alloc = BlockAllocator(num_blocks=4, block_size=16)
    prompt = list(range(33))
    owner = make_seq(prompt, "1")
    admit_and_compute(alloc, owner, upto=33)  # 3 blocks; 2 full, hashed
    block0, block1, _ = owner.block_table
    alloc.free(owner)
    assert alloc.num_free_blocks == 4 and set(alloc.evictable) == {block0, block1}
    assert alloc.match_prefix(make_seq(prompt, "2")) == [block0, block1]
    other = make_seq([7] * 32, "3")
    alloc.admit(other, 32, [])  # the two never-cached blocks come first
    assert set(other.block_table) == set(range(4)) - {block0, block1}
    assert alloc.match_prefix(make_seq(prompt, "4")) == [block0, block1]
    alloc.grow(other, 33)  # now the least recently used cached block goes: the tail one
    assert other.block_table[2] == block1
    assert alloc.match_prefix(make_seq(prompt, "5")) == [block0]
    alloc.grow(other, 49)
    assert alloc.match_prefix(make_seq(prompt, "6")) == []  # evicted hashes no longer hit
    check_blocks(alloc, [other.block_table])


def test_a_hit_on_an_evictable_block_uses_up_a_free_block():
    alloc = BlockAllocator(num_blocks=3, block_size=16)
    prompt = list(range(33))
    owner = make_seq(prompt, "1")
    admit_and_compute(alloc, owner)
    alloc.free(owner)
    again = make_seq(prompt + [5] * 15, "2")  # 48 tokens: 2 cached blocks + 1 fresh
    shared = alloc.match_prefix(again)
    assert alloc.num_blocks_to_take(again, 48, shared) == 3
    assert alloc.can_allocate(again, 48, shared) and not alloc.can_allocate(again, 49, shared)
    alloc.admit(again, 48, shared)
    assert alloc.num_free_blocks == 0
    check_blocks(alloc, [again.block_table])


def test_duplicate_prefixes_keep_one_cached_copy_and_hand_over():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    prompt = list(range(5))
    a, b = make_seq(prompt, "a"), make_seq(prompt, "b")
    for seq in (a, b):  # admitted in the same step: both miss, both compute block 0
        alloc.admit(seq, 5, alloc.match_prefix(seq))
    for seq in (a, b):
        seq.num_computed_tokens = 5
        alloc.commit(seq)
    assert alloc.match_prefix(make_seq(prompt, "c")) == [a.block_table[0]]
    alloc.free(a)
    check_blocks(alloc, [b.block_table])
    filler = make_seq([9] * 8, "f")
    alloc.admit(filler, 8, [])  # a's plain block, then a's cached one (evicted)
    assert alloc.match_prefix(make_seq(prompt, "c")) == []
    kept = b.block_table[0]
    alloc.free(b)  # b's copy now becomes the cached one
    assert alloc.match_prefix(make_seq(prompt, "c")) == [kept]
    check_blocks(alloc, [filler.block_table])


def test_a_reused_block_forgets_the_prefix_it_held():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    prompt = list(range(5))
    a, b = make_seq(prompt, "a"), make_seq(prompt, "b")
    for seq in (a, b):
        alloc.admit(seq, 5, [])
        seq.num_computed_tokens = 5
        alloc.commit(seq)
    alloc.free(b)  # its block 0 duplicates a's cached one: plain free, hash and all
    other = make_seq([8] * 9, "c")
    admit_and_compute(alloc, other, upto=8)  # reuses both of b's blocks
    assert alloc.match_prefix(make_seq([8] * 9, "d")) == other.block_table
    check_blocks(alloc, [a.block_table, other.block_table])


def test_without_prefix_caching_nothing_is_shared_or_kept():
    alloc = BlockAllocator(num_blocks=6, block_size=4, enable_prefix_caching=False)
    prompt = list(range(13))
    seq = make_seq(prompt)
    admit_and_compute(alloc, seq)
    alloc.free(seq)
    assert not alloc.evictable and alloc.match_prefix(make_seq(prompt, "2")) == []


class FakeKV:
    """Stands in for the cache's contents: slot -> the prefix whose last token it encodes.
    A block written while shared, or a wrong prefix hit, shows up as a mismatch."""

    def __init__(self, alloc: BlockAllocator) -> None:
        self.alloc, self.slots = alloc, {}

    def slot(self, seq: Sequence, p: int) -> int:
        bs = self.alloc.block_size
        return seq.block_table[p // bs] * bs + p % bs

    def compute(self, seq: Sequence, end: int) -> None:
        for p in range(seq.num_computed_tokens, end):
            assert self.alloc.ref_counts[seq.block_table[p // self.alloc.block_size]] == 1
            self.slots[self.slot(seq, p)] = tuple(seq.token_ids[: p + 1])
        seq.num_computed_tokens = end
        self.alloc.commit(seq)

    def check(self, seq: Sequence) -> None:
        for p in range(seq.num_computed_tokens):
            assert self.slots[self.slot(seq, p)] == tuple(seq.token_ids[: p + 1])


@pytest.mark.parametrize("freed_first", ["owner", "hitter"])
def test_freeing_one_of_two_sharers_keeps_the_shared_blocks_for_the_other(freed_first: str):
    """A prefix hit shares blocks, so freeing either holder may only drop a reference: if it
    released them, the pool would hand them out again while the other still reads them. The
    random test above finds such a bug only sometimes; here it is spelled out, freeing the
    block's first owner or the sequence that hit it, with exact counts at each step."""
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    kv = FakeKV(alloc)
    prompt = list(range(10))  # two full blocks and a partial one
    owner, hitter = make_seq(prompt, "owner"), make_seq(prompt + [50, 51], "hitter")
    alloc.admit(owner, 10, alloc.match_prefix(owner))
    kv.compute(owner, 10)
    shared = alloc.match_prefix(hitter)
    assert shared == owner.block_table[:2]
    alloc.admit(hitter, 12, shared)
    kv.check(hitter)  # reads the owner's keys and values for tokens 0..7
    kv.compute(hitter, 12)  # its third block is full: hashed too
    assert [alloc.ref_counts[b] for b in owner.block_table + hitter.block_table] == [2, 2, 1, 2, 2, 1]
    assert alloc.num_used_blocks == 4 and len(alloc.free_list) == 4 and not alloc.evictable
    probe = make_seq(prompt + [50, 51, 52], "probe")
    hitter_tail = hitter.block_table[2]
    assert alloc.match_prefix(probe) == shared + [hitter_tail]

    gone, kept = (owner, hitter) if freed_first == "owner" else (hitter, owner)
    gone_tail, kept_table = gone.block_table[2], list(kept.block_table)
    alloc.free(gone)
    assert [alloc.ref_counts[b] for b in kept_table] == [1, 1, 1] and alloc.ref_counts[gone_tail] == 0
    assert alloc.num_used_blocks == 3 and alloc.num_free_blocks == 5
    if gone is owner:  # its tail is partial, without a hash: plain free
        assert len(alloc.free_list) == 5 and gone_tail in alloc.free_list and not alloc.evictable
    else:  # its tail is full and hashed: kept in the cache
        assert len(alloc.free_list) == 4 and list(alloc.evictable) == [gone_tail]
    assert alloc.match_prefix(probe) == shared + [hitter_tail]  # hashes still hit
    check_blocks(alloc, [kept.block_table])

    filler = make_seq([7] * 20, "filler")  # takes every free block there is
    alloc.admit(filler, 20, [])
    kv.compute(filler, 20)  # five full blocks, hashed
    filler_table = list(filler.block_table)
    assert alloc.num_free_blocks == 0 and not set(filler_table) & set(kept_table)
    kv.check(kept)  # nobody wrote over the shared blocks
    check_blocks(alloc, [kept.block_table, filler_table])
    alloc.free(filler)
    assert [alloc.ref_counts[b] for b in kept_table] == [1, 1, 1]

    alloc.free(kept)  # the last holder: now they are free, the hashed ones kept in the cache, tail first
    cached = kept_table if kept is hitter else kept_table[:2]
    assert alloc.ref_counts == [0] * 8 and alloc.num_free_blocks == 8
    assert list(alloc.evictable) == filler_table[::-1] + cached[::-1]
    assert list(alloc.free_list) == [b for b in kept_table if b not in cached]
    assert alloc.match_prefix(probe) == cached
    check_blocks(alloc, [])


ops = st.lists(st.tuples(st.sampled_from("aaassf"), st.integers(0, 10**6)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(2, 12), block_size=st.integers(1, 6), caching=st.booleans(), ops=ops)
def test_random_allocations_never_leak_or_double_book(num_blocks, block_size, caching, ops):
    alloc, live = BlockAllocator(num_blocks, block_size, caching), []
    kv = FakeKV(alloc)
    stems = [[1, 2, 3, 1, 2, 3, 4] * 4, [1, 2, 3, 5] * 7]  # common prefixes, so blocks get shared
    for kind, r in ops:
        rng = random.Random(r)
        if kind == "a":  # admit a new sequence, computing part of it
            n = rng.randint(1, 20)
            seq = make_seq(rng.choice(stems)[:n] + [rng.randint(0, 2) for _ in range(rng.randint(0, 3))], str(r))
            shared = alloc.match_prefix(seq)
            upto = rng.randint(len(shared) * block_size + 1, seq.num_tokens)
            if alloc.can_allocate(seq, upto, shared):
                alloc.admit(seq, upto, shared)
                kv.check(seq)
                kv.compute(seq, upto)
                live.append(seq)
        elif kind == "s" and live:  # one step of a live sequence: finish its prefill or decode
            seq = rng.choice(live)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(rng.choice([1, 2, 3]))
            if alloc.can_allocate(seq, seq.num_tokens):
                alloc.grow(seq, seq.num_tokens)
                kv.compute(seq, seq.num_tokens)
        elif kind == "f" and live:
            alloc.free(live.pop(rng.randrange(len(live))))
        check_blocks(alloc, [s.block_table for s in live])
        for seq in live:
            kv.check(seq)
    for seq in live:
        alloc.free(seq)
    assert alloc.num_free_blocks == num_blocks
    check_blocks(alloc, [])


def test_a_hash_collision_is_a_miss_not_a_share(monkeypatch):
    """Every block hashing alike is the worst case a weak hash allows: a hit must still be
    proven by the block's own tokens, so a different prompt never gets another's keys."""
    from minillm.engine import block_allocator

    monkeypatch.setattr(block_allocator, "chain_hash", lambda parent, tokens: b"collide")
    alloc = BlockAllocator(num_blocks=16, block_size=4)
    first = make_seq(list(range(12)), "first")
    admit_and_compute(alloc, first)
    assert alloc.match_prefix(make_seq([99, 98, 97, 96, 95, 94, 93, 92, 91], "other")) == []
    assert alloc.match_prefix(make_seq([0, 1, 2, 3, 77, 77, 77, 77, 1], "half")) == first.block_table[:1]
    assert alloc.match_prefix(make_seq(list(range(12)) + [5], "same")) == first.block_table[:1]  # level 2 collides


def test_prefix_hashes_are_keyed_digests_that_depend_on_the_whole_prefix():
    from minillm.engine.block_allocator import chain_hash

    a = chain_hash(None, (1, 2, 3, 4))
    assert isinstance(a, bytes) and len(a) == 16 and a != chain_hash(None, (1, 2, 3, 5))
    assert chain_hash(a, (5, 6, 7, 8)) != chain_hash(chain_hash(None, (1, 2, 3, 5)), (5, 6, 7, 8))
    assert a != hash((None, (1, 2, 3, 4))).to_bytes(8, "little", signed=True)  # not Python's unkeyed hash
