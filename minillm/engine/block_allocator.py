"""The KV cache as a pool of fixed-size blocks: ``BlockAllocator``.

Paging (vLLM's PagedAttention) cuts the cache into blocks of ``block_size`` token slots and
gives a sequence blocks only as it grows, listed in its ``block_table``, so at most
``block_size - 1`` slots per sequence are wasted (chapter 6's cache reserved the longest answer).

Blocks are shared by reference count. With prefix caching a *full*, computed block gets a hash
chained over the whole prefix, ``H(parent_block_hash, tokens_of_this_block)``: equal hashes
mean equal tokens at equal positions, hence equal keys and values, so a new sequence shares
its matching leading blocks instead of recomputing them. A wrong match would leak another
request's text, so ``H`` is BLAKE2b keyed with a per-process secret and a hit must also match
the block's own tokens and parent hash. No block needs copy-on-write: only full blocks are
shared, and a sequence writes only past its computed tokens, in blocks it holds alone.

Freed blocks that carry a hash stay *evictable*, in least recently used order, where a later
request can still hit them; they count as free, and are reused only when the free list is empty.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence as BlockIds

from minillm.engine.sequence import Sequence

_HASH_KEY = os.urandom(16)  # per process: prefix hashes are never shared outside it


def chain_hash(parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """The prefix-cache key of one full block: its tokens, and (through ``parent``) every
    token before it. A 128-bit keyed BLAKE2b digest: unlike Python's ``hash()``, nobody
    without the key can search for two prompts that collide."""
    digest = hashlib.blake2b(parent or b"", key=_HASH_KEY, digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


class BlockAllocator:
    """A fixed pool of KV blocks, their reference counts (``ref_counts``), the free and
    ``evictable`` blocks, and the prefix-cache table with its statistics (tokens looked up and
    found at admissions)."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_list: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, bytes] = {}  # block -> its prefix hash (full, computed blocks)
        self._content: dict[int, tuple[bytes | None, tuple[int, ...]]] = {}  # block -> (parent hash, tokens)
        self._cached: dict[bytes, int] = {}  # prefix hash -> the block that holds it
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ------------------------------------------------------------------ sizes and statistics

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: the ceiling of the division."""
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks available now, counting evictable (cached but unowned) ones."""
        return len(self.free_list) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """The fraction of the pool held by sequences (vLLM's "KV cache usage")."""
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens found in the cache over prompt tokens looked up, at admissions."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # ------------------------------------------------------------------ prefix matching

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks ``seq`` could share: its leading full blocks whose hashes are in
        the table, stopping at the first miss. Changes nothing.

        At most ``(num_tokens - 1) // block_size`` blocks match, so at least one token is left
        to compute: the engine needs the logits of the last token to sample the next one, and
        only running the model on it gives them. A block whose hash matches but whose tokens
        or parent do not (a collision) is a miss.
        """
        if not self.enable_prefix_caching:
            return []
        matched: list[int] = []
        parent: bytes | None = None
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            key = chain_hash(parent, tokens)
            block = self._cached.get(key)
            if block is None or self._content[block] != (parent, tokens):
                break
            matched.append(block)
            parent = key
        return matched

    # ------------------------------------------------------------------ allocation

    def num_blocks_to_take(self, seq: Sequence, num_tokens: int, shared: BlockIds[int] = ()) -> int:
        """How many free blocks giving ``seq`` room for ``num_tokens`` tokens would use up: new
        ones, plus shared ones that are evictable now (held, they stop counting as free)."""
        fresh = max(0, self.blocks_for(num_tokens) - len(seq.block_table) - len(shared))
        return fresh + sum(self.ref_counts[b] == 0 for b in shared) if shared else fresh

    def can_allocate(self, seq: Sequence, num_tokens: int, shared: BlockIds[int] = ()) -> bool:
        """Whether the pool can give ``seq`` room for ``num_tokens`` tokens now."""
        return self.num_blocks_to_take(seq, num_tokens, shared) <= self.num_free_blocks

    def admit(self, seq: Sequence, num_tokens: int, shared: BlockIds[int]) -> None:
        """Give a sequence that holds no blocks its first ones: ``shared`` (from
        :meth:`match_prefix`), already computed, then fresh ones up to ``num_tokens`` tokens."""
        if seq.block_table:
            raise ValueError(f"request {seq.request_id!r} already holds blocks {seq.block_table}")
        for block in shared:
            self.evictable.pop(block, None)
            self.ref_counts[block] += 1
        seq.block_table = list(shared)
        seq.num_computed_tokens = seq.num_cached_prompt_tokens = len(shared) * self.block_size
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_cached_prompt_tokens
        self.grow(seq, num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append fresh blocks to ``seq``'s table until it holds ``num_tokens`` tokens (check
        :meth:`can_allocate` first)."""
        while len(seq.block_table) * self.block_size < num_tokens:
            block = self.take_free_block()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def take_free_block(self) -> int:
        """A never-cached free block if there is one; otherwise evict the least recently used
        cached block, forgetting its hash so it can no longer be hit."""
        if self.free_list:
            return self.free_list.popleft()
        if not self.evictable:
            raise RuntimeError("out of KV blocks: call can_allocate before allocating")
        block, _ = self.evictable.popitem(last=False)
        del self._cached[self._hash_of.pop(block)]
        del self._content[block]
        return block

    # ------------------------------------------------------------------ caching and freeing

    def commit(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Register the blocks of ``seq`` that are full and computed in the prefix cache: those
        within its first ``num_computed`` positions (by default ``seq.num_computed_tokens``;
        the engine passes what a finished step computed, not what later steps are scheduled to).

        Blocks get hashes in order, so hashed blocks form a prefix of the table: walk back from
        the last full block to the first one already hashed, then hash forward. If another
        block already holds the same prefix (two identical prompts computed in one step), the
        table keeps the first; this one carries the hash and can take over when freed.
        """
        if not self.enable_prefix_caching:
            return
        bs, table = self.block_size, seq.block_table
        end = (seq.num_computed_tokens if num_computed is None else num_computed) // bs
        start = end
        while start > 0 and table[start - 1] not in self._hash_of:
            start -= 1
        parent = self._hash_of[table[start - 1]] if start > 0 else None
        for i in range(start, end):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            key = chain_hash(parent, tokens)
            self._hash_of[table[i]], self._content[table[i]] = key, (parent, tokens)
            self._cached.setdefault(key, table[i])
            parent = key

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s reference to each of its blocks, last first, so the tail of a
        sequence (its least shareable part) is evicted before its prefix, as in vLLM."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.release_block(block)
        seq.block_table = []

    def release_block(self, block: int) -> None:
        """A block nobody holds any more: evictable if its content is cached, plain free otherwise."""
        h = self._hash_of.get(block)
        if h is not None and self._cached.setdefault(h, block) == block:
            self.evictable[block] = None
        else:
            self._hash_of.pop(block, None)
            self._content.pop(block, None)
            self.free_list.append(block)
