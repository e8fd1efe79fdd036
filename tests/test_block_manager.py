"""Tests of the paged KV-cache block manager: hand cases, then a stateful random test against a model KV store."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from eightbit.engine import block_manager as bm_module
from eightbit.engine.block_manager import BlockManager


def tokens(n, start=0):
    return list(range(start, start + n))


# ---------------------------------------------------------------- construction and accounting


@pytest.mark.parametrize("num_blocks, block_size, word", [(0, 16, "num_blocks"), (-3, 16, "num_blocks"),
                                                          (4, 0, "block_size"), (4, -1, "block_size")])
def test_bad_constructor_args(num_blocks, block_size, word):
    with pytest.raises(ValueError, match=rf"{word} must be >= 1, got {num_blocks if word == 'num_blocks' else block_size}"):
        BlockManager(num_blocks, block_size)


def test_allocate_and_free_accounting():
    bm = BlockManager(8, block_size=16)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (8, 0)
    assert bm.allocate("a", tokens(33)) == 0  # 33 tokens: 3 blocks
    assert len(bm.block_table("a")) == 3 and len(set(bm.block_table("a"))) == 3
    assert (bm.num_free_blocks, bm.num_used_blocks) == (5, 3)
    assert bm.allocate("b", tokens(16)) == 0
    assert bm.num_free_blocks == 4
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate("a", tokens(5))
    assert bm.allocate("empty", []) == 0 and bm.block_table("empty") == []
    bm.free("a")
    assert bm.num_free_blocks == 7
    bm.free("a")  # double free: no-op
    bm.free("never-seen")
    assert bm.num_free_blocks == 7
    bm.free("b")
    bm.free("empty")
    assert bm.num_free_blocks == 8
    assert bm.can_allocate(8) and not bm.can_allocate(9)


def test_append_slots_grows_table_one_block_at_a_time():
    bm = BlockManager(4, block_size=4)
    bm.allocate("s", tokens(3))
    assert len(bm.block_table("s")) == 1
    assert bm.append_slots("s", 4) == []  # fills block 0
    assert len(bm.block_table("s")) == 1
    assert bm.append_slots("s", 5) == []  # needs block 1
    assert len(bm.block_table("s")) == 2
    assert bm.append_slots("s", 5) == [] and len(bm.block_table("s")) == 2  # nothing new to hold
    assert bm.append_slots("s", 12) == []  # several blocks at once (speculative / chunked writes)
    assert len(bm.block_table("s")) == 3 and bm.num_free_blocks == 1


# ---------------------------------------------------------------- prefix caching


def test_prefix_hit_only_after_mark_computed():
    bm = BlockManager(16, block_size=4)
    prompt = tokens(10)  # blocks [0..3] [4..7] [8, 9]
    assert bm.allocate("a", prompt) == 0
    assert bm.allocate("b", prompt) == 0  # same step, nothing computed yet: no hit, not a bug
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    bm.mark_computed("a", prompt, 10)  # registers the two full blocks, not the partial one
    assert bm.allocate("c", prompt) == 8
    assert bm.block_table("c")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("c")[2] not in bm.block_table("a")
    assert [bm._ref[b] for b in bm.block_table("a")] == [2, 2, 1]
    assert bm.num_prefix_hit_tokens == 8 and bm.num_prefix_queried_tokens == 30
    # b ran the same prompt in the same step: its full blocks are registered too, as second copies.
    bm.mark_computed("b", prompt, 10)
    a_blocks, b_blocks = bm.block_table("a"), bm.block_table("b")
    for i in range(2):
        assert list(bm._cached[bm._block_hash[a_blocks[i]]]) == [a_blocks[i], b_blocks[i]]
    assert bm._block_hash[b_blocks[2]] is None
    # A prompt that diverges inside the second block hits the first only.
    assert bm.allocate("d", tokens(4) + [99] * 6) == 4
    # mark_computed counts only computed tokens: 7 of them make one full block.
    bm2 = BlockManager(8, block_size=4)
    bm2.allocate("a", prompt)
    bm2.mark_computed("a", prompt, 7)
    assert bm2.allocate("b", prompt) == 4
    with pytest.raises(ValueError, match="exceeds"):
        bm2.mark_computed("a", prompt, 11)
    bm2.mark_computed("gone", prompt, 10)  # unknown sequence: no-op


def test_last_token_is_always_recomputed():
    bm = BlockManager(16, block_size=4)
    prompt = tokens(8)  # exactly two full blocks
    bm.allocate("a", prompt)
    bm.mark_computed("a", prompt, 8)
    assert bm.allocate("b", prompt) == 4  # a full hit would leave nothing to run: drop the last block
    assert bm.block_table("b")[0] == bm.block_table("a")[0]
    assert bm.block_table("b")[1] != bm.block_table("a")[1]
    assert bm.allocate("c", prompt + [100]) == 8  # one more token: both blocks hit
    assert bm.allocate("d", prompt[:1]) == 0
    assert bm.allocate("e", prompt[:5]) == 4


def test_hash_collision_is_rejected_by_token_check(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, toks: b"same for everyone")
    bm = BlockManager(16, block_size=4)
    a = tokens(9)
    bm.allocate("a", a)
    bm.mark_computed("a", a, 9)  # both full blocks register under the one key
    assert bm.allocate("b", tokens(9, start=50)) == 0  # same key, different tokens: no hit
    assert not set(bm.block_table("b")) & set(bm.block_table("a"))
    assert bm.allocate("c", a) == 8  # same tokens: the genuine hits still work
    assert bm.block_table("c")[:2] == bm.block_table("a")[:2]
    # The first block's tokens again in second place (another parent) are no hit either.
    assert bm.allocate("d", a[:4] + a[:4] + [7]) == 4


def test_free_keeps_cache_and_hit_revives_block():
    bm = BlockManager(4, block_size=4)
    prompt = tokens(9)
    bm.allocate("a", prompt)
    bm.mark_computed("a", prompt, 9)
    cached = bm.block_table("a")[:2]
    bm.free("a")
    assert bm.num_free_blocks == 4  # cached-but-unreferenced blocks count as free
    assert bm.allocate("b", prompt) == 8
    assert bm.block_table("b")[:2] == cached
    assert [bm._ref[x] for x in cached] == [1, 1] and not set(cached) & set(bm._free)
    assert bm.num_free_blocks == 1


def test_eviction_is_lru_and_drops_the_hash():
    bm = BlockManager(4, block_size=2)
    p, q = [1, 2, 3], [5, 6, 7]
    for seq, prompt in (("p", p), ("q", q)):
        bm.allocate(seq, prompt)
        bm.mark_computed(seq, prompt, 3)
    p_head, p_tail = bm.block_table("p")
    q_head, q_tail = bm.block_table("q")
    bm.free("p")
    bm.free("q")
    # Unregistered tails first (nothing to keep), then cached heads in the order they were freed.
    assert list(bm._free) == [q_tail, p_tail, p_head, q_head]
    bm.allocate("x", tokens(5, start=100))  # 3 blocks: both tails, then p's head, the least recently freed
    assert bm.block_table("x") == [q_tail, p_tail, p_head]
    assert bm._block_hash[p_head] is None and bm._block_hash[q_head] is not None
    assert list(bm._free) == [q_head]
    bm.free("x")
    assert bm.allocate("p2", p) == 0  # p's head was handed out: its entry is gone
    bm.free("p2")
    assert bm.allocate("q2", q) == 2  # q's head survived in the free queue
    assert bm.block_table("q2")[0] == q_head


def test_free_releases_tail_before_head():
    bm = BlockManager(6, block_size=2)
    prompt = tokens(7)
    bm.allocate("a", prompt)
    bm.mark_computed("a", prompt, 7)
    table = bm.block_table("a")
    bm.free("a")
    # Tail first among the cached blocks, so that the shared-prone head is evicted last.
    assert list(bm._free)[-3:] == [table[2], table[1], table[0]]


def test_a_prefix_hit_shares_the_copy_in_use_rather_than_reviving_a_free_one():
    """Two registered copies of a block, one in use and one freed (still cached): a hit shares the one in use,
    which costs no free block and keeps the other one's cache entry."""
    bm = BlockManager(5, block_size=4)
    prompt = tokens(5)
    for s in ("a", "b"):
        bm.allocate(s, prompt)
    for s in ("a", "b"):
        bm.mark_computed(s, prompt, 5)
    bm.free("b")
    assert bm.num_free_blocks == 3
    assert bm.allocate("c", prompt) == 4
    assert bm.block_table("c")[0] == bm.block_table("a")[0] and bm.num_free_blocks == 2


def test_prefix_caching_disabled():
    bm = BlockManager(8, block_size=4, enable_prefix_caching=False)
    prompt = tokens(9)
    bm.allocate("a", prompt)
    bm.mark_computed("a", prompt, 9)
    assert bm.allocate("b", prompt) == 0 and bm.num_prefix_hit_tokens == 0
    assert not bm._cached
    assert bm.num_prefix_queried_tokens == 0  # nothing was looked up


def test_a_request_that_skips_the_cache_is_not_counted_as_queried():
    """A prompt-logprobs request skips the lookup (it needs every position's logits): it is neither a hit nor a
    miss, so the hit rate is that of the requests that asked."""
    bm = BlockManager(8, block_size=4)
    prompt = tokens(9)
    bm.allocate("a", prompt)
    bm.mark_computed("a", prompt, 9)
    assert bm.allocate("b", prompt, use_prefix_cache=False) == 0
    assert bm.allocate("c", prompt) == 8
    assert (bm.num_prefix_hit_tokens, bm.num_prefix_queried_tokens) == (8, 18)


# ---------------------------------------------------------------- fork and copy-on-write


def test_copy_on_write_after_fork():
    bm = BlockManager(8, block_size=4)
    bm.allocate("p", tokens(6))  # blocks: [full, half]
    full, half = bm.block_table("p")
    bm.fork("p", "c")
    assert bm.block_table("c") == [full, half]
    assert (bm._ref[full], bm._ref[half]) == (2, 2)
    copies = bm.append_slots("p", 7)  # p writes token 6 into the shared half block
    assert len(copies) == 1 and copies[0][0] == half
    new = copies[0][1]
    assert new not in (full, half)
    assert bm.block_table("p") == [full, new] and bm.block_table("c") == [full, half]
    assert (bm._ref[full], bm._ref[half], bm._ref[new]) == (2, 1, 1)
    assert bm.append_slots("c", 7) == []  # the child is the last reader now: it writes in place
    assert bm.block_table("c") == [full, half]
    assert bm.append_slots("p", 8) == []  # p's block is its own
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == 8 and not any(bm._ref)


def test_fork_at_block_boundary_needs_no_copy():
    bm = BlockManager(8, block_size=4)
    bm.allocate("p", tokens(8))
    bm.fork("p", "c")
    assert bm.append_slots("p", 9) == [] and bm.append_slots("c", 9) == []
    assert bm.block_table("p")[:2] == bm.block_table("c")[:2]
    assert bm.block_table("p")[2] != bm.block_table("c")[2]
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.fork("p", "c")


def test_copy_on_write_keeps_original_cached():
    bm = BlockManager(8, block_size=4)
    prompt = tokens(8)
    bm.allocate("p", prompt)
    bm.mark_computed("p", prompt, 8)
    original = bm.block_table("p")[1]
    # Shrink p's known length so that its next write lands in the full, cached block (only a caller that
    # rewrites tokens would do this; it shows the cache entry follows the content, not the writer).
    bm._num_tokens["p"] = 6
    bm.fork("p", "c")
    [(src, dst)] = bm.append_slots("p", 8)
    assert src == original and bm._block_hash[original] is not None and bm._block_hash[dst] is None
    bm.free("p")
    bm.free("c")
    assert bm.allocate("q", prompt + [0]) == 8 and bm.block_table("q")[1] == original


# ---------------------------------------------------------------- out of blocks


def snapshot(bm):
    return (list(bm._free), list(bm._ref), {h: list(bs) for h, bs in bm._cached.items()}, {s: list(t) for s, t in bm._tables.items()},
            dict(bm._num_tokens), bm.num_prefix_hit_tokens, bm.num_prefix_queried_tokens, bm._rows.tolist(),
            list(bm._free_rows))


def test_block_tables_gathers_rows_and_max_blocks_per_seq_is_enforced():
    bm = BlockManager(64, block_size=4, max_blocks_per_seq=3)
    for i in range(20):  # more sequences than the rows first allocated: the array grows
        assert bm.allocate(i, tokens(1 + i % 12)) == 0
    rows, lengths = bm.block_tables([5, 0, 11])
    assert lengths == [2, 1, 3] and rows.shape == (3, 3)
    assert rows.tolist() == [bm.block_table(5) + [0], bm.block_table(0) + [0, 0], bm.block_table(11)]
    bm.free(11)
    assert bm.allocate("new", tokens(2)) == 0  # takes the freed row, which must read as its one block
    assert bm.block_tables(["new"])[0].tolist() == [bm.block_table("new")]
    before = snapshot(bm)
    with pytest.raises(ValueError, match=r"13 tokens need 4 blocks, more than max_blocks_per_seq=3"):
        bm.allocate("long", tokens(13))
    with pytest.raises(ValueError, match=r"13 tokens need 4 blocks, more than max_blocks_per_seq=3"):
        bm.append_slots(10, 13)
    assert snapshot(bm) == before
    with pytest.raises(ValueError, match="max_blocks_per_seq must be >= 1, got 0"):
        BlockManager(4, max_blocks_per_seq=0)


def test_out_of_blocks_returns_none_and_changes_nothing():
    bm = BlockManager(3, block_size=4)
    prompt = tokens(5)
    bm.allocate("a", prompt)
    bm.mark_computed("a", prompt, 5)
    bm.free("a")
    bm.allocate("b", tokens(6, start=50))  # 2 blocks: the unregistered one, then a fresh one
    before = snapshot(bm)
    assert bm.allocate("c", tokens(9, start=90)) is None  # needs 3, 1 free
    assert bm.allocate("d", prompt + [1, 2, 3, 4]) is None  # 1 hit (revived from the queue) + 2 new > 1 free
    assert snapshot(bm) == before
    assert bm.append_slots("b", 8) == []  # fits in its last block
    assert bm.append_slots("b", 13) is None  # needs 2 more, 1 free
    assert bm.append_slots("b", 12) == []  # takes the last free block, evicting a's cached one
    assert bm.num_free_blocks == 0 and not bm._cached
    assert bm.allocate("e", []) == 0  # needs nothing
    bm.fork("b", "b2")
    before = snapshot(bm)
    assert bm.append_slots("b", 13) is None  # its last block is full, a new one is needed
    assert snapshot(bm) == before
    # A hit waiting in the free queue costs a free block too.
    bm3 = BlockManager(2, block_size=4)
    bm3.allocate("a", tokens(5))
    bm3.mark_computed("a", tokens(5), 5)
    bm3.free("a")
    bm3.allocate("b", [99] * 4)  # takes the unregistered block; the cached one is the last free block
    before = snapshot(bm3)
    assert bm3.allocate("c", tokens(5)) is None  # 1 revived hit + 1 new > 1 free
    assert snapshot(bm3) == before
    bm3.free("b")
    assert bm3.allocate("c", tokens(5)) == 4
    bm2 = BlockManager(2, block_size=4)
    bm2.allocate("p", tokens(6))
    bm2.fork("p", "c")
    before = snapshot(bm2)
    assert bm2.append_slots("p", 7) is None  # copy-on-write needs one free block, there is none
    assert snapshot(bm2) == before


# ---------------------------------------------------------------- stateful random test


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / preempt / mark_computed, checked against a model.

    The model "KV store" is simulated memory: each slot of each block holds (position, token id), as real KV
    depends on both. Writes follow the block tables the manager returns, copy-on-write copies are done as
    told, and memory is never cleared on free. If each live sequence's blocks always read back exactly its
    tokens, then prefix hits, copy-on-write and eviction are all right.
    """

    @initialize(num_blocks=st.integers(1, 16), block_size=st.integers(1, 4), caching=st.sampled_from([True] * 3 + [False]))
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size
        self.kv = {b: [None] * block_size for b in range(num_blocks)}
        self.tokens = {}  # live seq -> its tokens, all written to the KV store
        self.waiting = {}  # preempted seq that could not get its blocks back -> its tokens
        self.history = [[]]  # token lists seen, to draw prompts sharing prefixes
        self.next_id = 0
        self.hit_tokens = 0

    # -- helpers

    def holders(self):
        return Counter(b for s in self.tokens for b in self.bm.block_table(s))

    def write(self, data, seq, start):
        """Simulate the model writing KV of tokens[start:] of seq: each target block must be seq's alone.

        Then, usually, tell the manager (as the engine does after each step); sometimes leave it to the
        mark_computed rule, to have registration lag behind.
        """
        table, toks, holders = self.bm.block_table(seq), self.tokens[seq], self.holders()
        for p in range(start, len(toks)):
            b = table[p // self.bs]
            assert holders[b] == 1, f"seq {seq} writes into block {b} shared by {holders[b]} sequences"
            self.kv[b][p % self.bs] = (p, toks[p])
        if data.draw(st.integers(0, 3)):
            self.bm.mark_computed(seq, toks, len(toks))

    def try_allocate(self, data, seq, toks):
        before = (self.bm.num_free_blocks, list(self.bm._free))
        cached = self.bm.allocate(seq, toks)
        if cached is None:
            assert (self.bm.num_free_blocks, list(self.bm._free)) == before
            with pytest.raises(KeyError):
                self.bm.block_table(seq)
            self.waiting[seq] = toks
            return
        assert cached % self.bs == 0 and (cached < len(toks) or cached == 0)
        if not self.bm.enable_prefix_caching:
            assert cached == 0
        self.hit_tokens += cached
        self.tokens[seq] = list(toks)
        table = self.bm.block_table(seq)
        assert len(table) == -(-len(toks) // self.bs)
        for p in range(cached):  # the hit blocks hold exactly the requested tokens
            assert self.kv[table[p // self.bs]][p % self.bs] == (p, toks[p])
        self.write(data, seq, cached)
        self.history.append(list(toks))

    def pick(self, data, pool):
        return data.draw(st.sampled_from(sorted(pool)))

    def new_tokens(self, data, n):
        return data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))

    # -- rules

    @rule(data=st.data())
    def allocate_new(self, data):
        base = data.draw(st.sampled_from(self.history))
        prefix = base[: data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))]
        toks = prefix + self.new_tokens(data, data.draw(st.integers(0, 2 * self.bs + 1)))
        self.next_id += 1
        self.try_allocate(data, self.next_id, toks)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def retry_waiting(self, data):
        seq = self.pick(data, self.waiting)
        self.try_allocate(data, seq, self.waiting.pop(seq))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append(self, data):
        self.append_to(data, self.pick(data, self.tokens))

    def append_to(self, data, seq):
        k = data.draw(st.integers(1, self.bs + 1))
        old_table, old_len = self.bm.block_table(seq), len(self.tokens[seq])
        free_before = self.bm.num_free_blocks
        copies = self.bm.append_slots(seq, old_len + k)
        if copies is None:
            assert self.bm.block_table(seq) == old_table and self.bm.num_free_blocks == free_before
            return
        table = self.bm.block_table(seq)
        assert len(table) == -(-(old_len + k) // self.bs) and len(copies) <= 1
        for src, dst in copies:
            i = old_len // self.bs
            assert old_table[i] == src and table[i] == dst and table[:i] == old_table[:i]
            self.kv[dst] = list(self.kv[src])
        self.tokens[seq] += self.new_tokens(data, k)
        self.write(data, seq, old_len)
        self.history.append(list(self.tokens[seq]))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.pick(data, self.tokens)
        self.next_id += 1
        self.bm.fork(parent, self.next_id)
        self.tokens[self.next_id] = list(self.tokens[parent])
        if data.draw(st.booleans()):  # decode right away (copy-on-write territory), parent or child first
            first, second = data.draw(st.permutations([parent, self.next_id]))
            self.append_to(data, first)
            self.append_to(data, second)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), twice=st.booleans())
    def free(self, data, twice):
        seq = self.pick(data, self.tokens)
        self.bm.free(seq)
        if twice:
            self.bm.free(seq)
        del self.tokens[seq]

    @rule()
    def free_unknown(self):
        self.bm.free("nobody")

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def preempt(self, data):
        seq = self.pick(data, self.tokens)
        toks = self.tokens.pop(seq)
        self.bm.free(seq)
        self.try_allocate(data, seq, toks)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def mark_computed(self, data):
        seq = self.pick(data, self.tokens)
        toks = self.tokens[seq]
        n = data.draw(st.integers(0, len(toks)))
        self.bm.mark_computed(seq, toks, n)
        # The computed prefix is now findable: a probe sharing it hits every full block of it (when there are
        # free blocks for the rest; a hit taken from the free queue needs one too).
        self.next_id += 1
        cached = self.bm.allocate(self.next_id, toks[:n] + [3])
        if cached is not None:
            assert cached == (n // self.bs * self.bs if self.bm.enable_prefix_caching else 0)
            self.hit_tokens += cached
            self.bm.free(self.next_id)

    # -- invariants

    @invariant()
    def consistent(self):
        bm, holders = self.bm, self.holders()
        for seq, toks in self.tokens.items():
            table = bm.block_table(seq)
            assert len(table) == -(-len(toks) // self.bs) and len(set(table)) == len(table)
            for p, t in enumerate(toks):  # each sequence's blocks hold exactly its tokens
                assert self.kv[table[p // self.bs]][p % self.bs] == (p, t)
        free = list(bm._free)
        assert len(free) == bm.num_free_blocks == bm.num_blocks - bm.num_used_blocks
        assert not set(free) & set(holders)  # a block is either free or held, never both
        assert len(free) + len(holders) == bm.num_blocks  # no leak
        assert bm._ref == [holders[b] for b in range(bm.num_blocks)]  # refcount == number of holders
        seqs = sorted(self.tokens)
        rows, lengths = bm.block_tables(seqs)  # the array the model runner gathers: the same tables, zero-padded
        assert lengths == [len(bm.block_table(s)) for s in seqs] and rows.dtype == np.int32
        assert rows.tolist() == [bm.block_table(s) + [0] * (rows.shape[1] - n) for s, n in zip(seqs, lengths)]
        assert not bm._rows[bm._free_rows].any()  # a freed table leaves no ids behind in its row
        registered = [b for blocks in bm._cached.values() for b in blocks]
        for h, blocks in bm._cached.items():  # a cached block still holds the tokens it is registered under
            assert blocks
            for b in blocks:
                assert bm._block_hash[b] == h
                assert [slot[1] for slot in self.kv[b]] == list(bm._block_key[b][1])
        assert sum(h is not None for h in bm._block_hash) == len(registered)
        assert bm.num_prefix_hit_tokens == self.hit_tokens


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_block_manager_stateful = BlockManagerMachine.TestCase


def test_allocate_without_prefix_lookup_computes_everything_but_still_registers():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    assert bm.allocate("a", tokens) == 0
    bm.mark_computed("a", tokens, 10)
    assert bm.allocate("b", tokens, use_prefix_cache=False) == 0
    assert set(bm.block_table("a")).isdisjoint(bm.block_table("b"))
    bm.mark_computed("b", tokens, 10)
    bm.free("a")
    bm.free("b")
    assert bm.allocate("c", tokens) == 8  # both copies were registered; either serves the hit


def test_copies_due_follow_append_slots_and_drop_with_their_destination():
    bm = BlockManager(8, block_size=4)
    bm.allocate("a", [1, 2, 3, 4, 5])  # the second block half full
    bm.fork("a", "b")
    copies = bm.append_slots("b", 6)  # b writes into the shared block: a copy
    assert len(copies) == 1 and bm.copies_due == copies
    bm.fork("a", "c")
    bm.free("c")  # a sequence without a copy due goes: nothing changes
    assert bm.copies_due == copies
    bm.free("a")  # the copy's source loses a reader; its destination is still b's
    assert bm.copies_due == copies
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.fork("a", "d")
    more = bm.append_slots("d", 6)
    assert bm.copies_due == copies + more
    bm.free("d")  # its request aborted before the copy was done; a still reads the source
    assert bm.copies_due == copies
