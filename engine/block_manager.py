"""Paged KV-cache block manager: which KV-cache block holds which tokens of which sequence.

The KV cache is one pool of `num_blocks` fixed-size blocks of `block_size` token slots. A sequence owns a
*block table*, the list of its block ids in order: token i lives in slot i % block_size of block
table[i // block_size]. This module only hands out block ids; the model runner reads the tables and does
the actual KV writes and copies. No torch here.

Three ideas, after vLLM's KVCacheManager/BlockPool:

* Reference counts: several sequences may read one block (a shared prompt prefix, or the samples of a
  request with n > 1). A block returns to the free queue when its last reader lets it go.
* Prefix caching: once a full block's KV is computed it is registered under a hash chain,
  h_i = H(h_{i-1}, tokens of block i), so its key stands for the whole prefix up to its end (KV depends on
  every earlier token, not just the block's own). A new prompt walks its blocks and reuses each one found.
  Freed blocks keep their content and key until the free queue hands them out again, so a finished
  request's prompt can still be hit later: the free queue doubles as the LRU cache.
* Copy-on-write: a sequence never writes into a block another one reads; it gets a private copy first.

Each table is kept twice: as a Python list, which the logic here reads, and as a row of one int32 numpy array,
zero past the table's end, which a step's input building gathers in one call (`block_tables`) instead of
converting B lists of Python ints (~0.5 ms at B = 256 on the development CPU, where a decode step's whole host
budget is a few ms).
"""

import hashlib
from array import array
from collections import OrderedDict

import numpy as np


class NoFreeBlocksError(RuntimeError):
    """The free queue is empty. Public calls check counts first and return None instead of raising."""


def hash_block(parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """Chain hash of one full block: SHA-256 over the parent block's hash and this block's token ids.

    Not Python's hash(): it is 64 bits and not collision resistant, so crafted prompts could give two different
    prefixes one key and let a request read another's KV. One SHA-256 per block costs about a microsecond.
    """
    h = hashlib.sha256(parent or b"")
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 max_blocks_per_seq: int | None = None):
        """max_blocks_per_seq: the longest table a sequence may hold (the engine's max_model_len in blocks); the
        width of the table rows. None: num_blocks, which costs num_blocks int32s a live sequence (fine for the small
        pools of tests; a large cache should pass its own)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_blocks_per_seq is not None and max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks  # readers of each block
        # Unreferenced blocks, the next one to hand out first. An OrderedDict so that a prefix hit can pull a
        # cached block out of the middle in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # chain hash -> its registered blocks (more than one when equal prompts ran in the same step; an
        # ordered dict, used as an ordered set)
        self._cached: dict[bytes, dict[int, None]] = {}
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._block_key: list[tuple | None] = [None] * num_blocks  # (parent hash, tokens), to verify a hit
        self._tables: dict = {}  # seq_id -> block ids
        self._rows = np.zeros((0, max_blocks_per_seq or num_blocks), np.int32)  # the tables again, one row each
        self._row: dict = {}  # seq_id -> its row of _rows
        self._free_rows: list[int] = []
        self._num_tokens: dict = {}  # seq_id -> tokens its table holds (its length as last told)
        self._hashes: dict = {}  # seq_id -> chain hashes of its leading computed full blocks
        # copy-on-write copies handed out by append_slots and not done yet: the tables point at the new blocks
        # already, so whoever runs the next step must do these first, even if the step they were made for failed
        self.copies_due: list[tuple[int, int]] = []
        self.num_prefix_hit_tokens = 0  # tokens served from the cache by allocate()
        self.num_prefix_queried_tokens = 0  # tokens looked up by allocate(); hit rate = hit / queried

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def block_table(self, seq_id) -> list[int]:
        """One sequence's table, a copy as a list (a step's batch of them: block_tables)."""
        return list(self._tables[seq_id])

    def block_tables(self, seq_ids) -> tuple[np.ndarray, list[int]]:
        """The tables of seq_ids as a new int32 array [len(seq_ids), longest table], zero-padded, and each one's
        length."""
        lengths = [len(self._tables[s]) for s in seq_ids]
        rows = [self._row[s] for s in seq_ids]
        return self._rows[rows, : max(lengths, default=0)], lengths

    def allocate(self, seq_id, token_ids: list[int], use_prefix_cache: bool = True) -> int | None:
        """Give a new (or preempted-and-restarting) sequence blocks for all of token_ids.

        Returns how many leading tokens already have KV in the cache (a multiple of block_size, always less than
        len(token_ids)), or None, changing nothing, when there are not enough free blocks. use_prefix_cache=False
        skips the lookup (a request scoring its prompt needs every position computed); its blocks are still
        registered once computed.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; free it first")
        looked_up = use_prefix_cache and self.enable_prefix_caching
        hits, hashes = self._find_cached(token_ids) if looked_up else ([], [])
        num_new = self._blocks_for(len(token_ids)) - len(hits)
        num_revived = sum(1 for b in hits if self._ref[b] == 0)  # hits that sit in the free queue
        if num_new + num_revived > len(self._free):
            return None
        if len(hits) + num_new > self._rows.shape[1]:
            raise ValueError(f"{len(token_ids)} tokens need {len(hits) + num_new} blocks, more than "
                             f"max_blocks_per_seq={self._rows.shape[1]}")
        for b in hits:  # take the hits first, so that handing out new blocks cannot evict them
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        self._tables[seq_id] = hits + [self._take_free() for _ in range(num_new)]
        self._set_row(seq_id)
        self._num_tokens[seq_id] = len(token_ids)
        self._hashes[seq_id] = hashes
        num_cached = len(hits) * self.block_size
        if looked_up:  # a request that skips the cache (or a cache turned off) must not dilute the hit rate
            self.num_prefix_hit_tokens += num_cached
            self.num_prefix_queried_tokens += len(token_ids)
        return num_cached

    def append_slots(self, seq_id, num_tokens: int) -> list[tuple[int, int]] | None:
        """Make the sequence's table hold num_tokens tokens before the step that writes tokens up to there.

        The step writes from the sequence's previous length on. Only the block holding that first position can
        already exist (the table holds exactly the blocks its length needs), so it is the only one that may be
        shared and need copy-on-write. Returns the [(src, dst)] block copies to do before writing (usually none;
        also added to copies_due, for the caller to clear once done), or None, changing nothing, when blocks run
        out.
        """
        table = self._tables[seq_id]
        old = self._num_tokens[seq_id]
        if num_tokens <= old:
            return []
        if num_tokens <= len(table) * self.block_size and self._ref[table[old // self.block_size]] == 1:
            self._num_tokens[seq_id] = num_tokens  # a decode step's usual case: room in its own last block
            return []
        num_new = max(0, self._blocks_for(num_tokens) - len(table))
        i = old // self.block_size  # block receiving the first token not yet written
        cow = i < len(table) and self._ref[table[i]] > 1
        if num_new + cow > len(self._free):
            return None
        if len(table) + num_new > self._rows.shape[1]:
            raise ValueError(f"{num_tokens} tokens need {len(table) + num_new} blocks, more than "
                             f"max_blocks_per_seq={self._rows.shape[1]}")
        copies = []
        if cow:  # the other readers keep the old block (and its cache entry, if any)
            self._ref[table[i]] -= 1
            copies.append((table[i], self._take_free()))
            table[i] = copies[0][1]
            self.copies_due.append(copies[0])
        table.extend(self._take_free() for _ in range(num_new))
        if cow or num_new:
            self._rows[self._row[seq_id], i : len(table)] = table[i:]
        self._num_tokens[seq_id] = num_tokens
        return copies

    def fork(self, parent_id, child_id) -> None:
        """The child shares all the parent's blocks and its length (parallel sampling, n > 1)."""
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} already holds blocks")
        table = self._tables[parent_id]
        for b in table:
            self._ref[b] += 1
        self._tables[child_id] = list(table)
        self._set_row(child_id)
        self._num_tokens[child_id] = self._num_tokens[parent_id]
        self._hashes[child_id] = list(self._hashes[parent_id])

    def free(self, seq_id) -> None:
        """Release the sequence's blocks; an unknown seq_id is a no-op (an abort after finishing is fine).

        A block nobody reads any more joins the free queue. Blocks are released tail first, since a prompt's
        tail is the part least likely to be shared, so it should be evicted before the head. A block with a
        cache entry goes to the queue's end, to be revived by a hit or evicted last; one without goes to the
        front: there is nothing in it worth keeping.
        """
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        del self._num_tokens[seq_id], self._hashes[seq_id]
        row = self._row.pop(seq_id)
        self._rows[row, : len(table)] = 0
        self._free_rows.append(row)
        for b in reversed(table):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if self._block_hash[b] is None:
                    self._free.move_to_end(b, last=False)
        if self.copies_due:  # a copy into a block nobody reads any more must not land on its next owner
            self.copies_due[:] = [(src, dst) for src, dst in self.copies_due if self._ref[dst] > 0]

    def mark_computed(self, seq_id, token_ids: list[int], num_computed_tokens: int) -> None:
        """The sequence's KV now exists for its first num_computed_tokens tokens: cache its full blocks.

        Registration waits for this call, not allocation: a block is only worth sharing once its KV is written.
        A block with the same prefix as one cached already (two equal prompts run in the same step) is
        registered too, so the prefix stays cached for as long as either copy lives. An unknown seq_id (freed
        already) is a no-op.
        """
        if not self.enable_prefix_caching or seq_id not in self._tables:
            return
        if num_computed_tokens > min(len(token_ids), self._num_tokens[seq_id]):
            raise ValueError(f"num_computed_tokens={num_computed_tokens} exceeds the sequence's tokens")
        table, hashes, bs = self._tables[seq_id], self._hashes[seq_id], self.block_size
        for i in range(len(hashes), num_computed_tokens // bs):
            parent, tokens = hashes[-1] if hashes else None, tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, tokens)
            hashes.append(h)
            b = table[i]
            if self._block_hash[b] is None:
                self._cached.setdefault(h, {})[b] = None
                self._block_hash[b], self._block_key[b] = h, (parent, tokens)

    def _find_cached(self, token_ids: list[int]) -> tuple[list[int], list[bytes]]:
        """The cached blocks of token_ids' longest cached prefix of full blocks, and their chain hashes.

        Only the first (len - 1) // block_size blocks are looked up: the last token is always recomputed, since
        the model must run on at least one token to give the logits of the next. Each hit is also checked against
        the block's stored tokens and parent hash, so a collision of its own hash cannot hand out another
        prefix's KV (what comes before rests on the SHA-256 chain). Among equal copies, one in use is preferred:
        reviving one from the free queue would cost a free block.
        """
        hits, hashes, parent, bs = [], [], None, self.block_size
        if not self.enable_prefix_caching:
            return hits, hashes
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, tokens)
            found = [b for b in self._cached.get(h, ()) if self._block_key[b] == (parent, tokens)]
            if not found:
                break
            b = min(found, key=lambda c: self._ref[c] == 0)
            hits.append(b)
            hashes.append(h)
            parent = h
        return hits, hashes

    def _take_free(self) -> int:
        """Hand out the free queue's first block for new content; its old cache entry, if any, is dropped."""
        if not self._free:
            raise NoFreeBlocksError("no free KV-cache blocks")
        b, _ = self._free.popitem(last=False)
        if self._block_hash[b] is not None:
            h = self._block_hash[b]
            del self._cached[h][b]
            if not self._cached[h]:
                del self._cached[h]
            self._block_hash[b] = self._block_key[b] = None
        self._ref[b] = 1
        return b

    def _set_row(self, seq_id) -> None:
        """Give a new table its row (growing the array when every row is taken) and copy the table in."""
        if not self._free_rows:
            grown = max(16, 2 * len(self._rows))
            self._free_rows = list(range(grown - 1, len(self._rows) - 1, -1))
            self._rows = np.concatenate([self._rows, np.zeros((grown - len(self._rows), self._rows.shape[1]),
                                                              np.int32)])
        row = self._row[seq_id] = self._free_rows.pop()
        table = self._tables[seq_id]
        self._rows[row, : len(table)] = table

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
