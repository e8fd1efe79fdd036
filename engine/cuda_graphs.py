"""Steps replayed as CUDA graphs: decode steps per batch-size bucket, short prefills per token bucket.

Run eagerly, a step costs one Python-level launch per kernel (~11 per layer), so a decode
step or a short prefill is bound by the host, not the GPU (Llama-3-8B, a 512-token prompt:
~11 ms of kernels in a ~20 ms eager step). A graph replays the whole forward with one
launch. The graphs read their inputs from static buffers: a step copies its inputs in,
pads up to the bucket with rows that write nowhere (cache slot -1) and replays. All graphs
share one memory pool (their replays never overlap), captured largest first.
"""

import torch

from eightbit.engine.context import Context, reset_context, set_context


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16)) + [max_batch]
    return sorted({s for s in sizes if s <= max_batch})


def token_buckets(max_tokens: int) -> list[int]:
    """Prefill graph sizes: at most 127 padding tokens above 128, at most half below; none below 16."""
    if max_tokens < 16:
        return []
    sizes = [16, 32, 64] + list(range(128, max_tokens + 1, 128)) + [max_tokens]
    return sorted({s for s in sizes if s <= max_tokens})


class _Graphs:
    """Static input buffers, one graph per bucket, and the capture loop shared by both kinds."""

    def __init__(self, model, buckets, rows, table_rows, table_width, hidden_size, dtype, device):
        self.model = model
        self.buckets = buckets
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(table_rows, table_width, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        self.graphs = {}
        self._pinned = torch.device(device).type == "cuda"

    @torch.inference_mode()
    def capture(self, pool=None):
        """Capture every bucket into `pool` (None: a new one); returns the pool for the next capture."""
        for size in reversed(self.buckets):
            self._fill_for_capture(size)
            try:
                set_context(self._context(size, warm_up=True))
                self._forward(size)  # warm-up: compiles kernels, settles allocations
                torch.cuda.synchronize()
                set_context(self._context(size, warm_up=False))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self._forward(size)
            finally:
                reset_context()
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        return pool

    def _fill_for_capture(self, size):
        """Buffer values for the capture (every token's slot stays -1: nothing is written)."""

    def _forward(self, rows):
        self.hidden[:rows] = self.model(self.input_ids[:rows], self.positions[:rows])

    def _bucket(self, n):
        return next(size for size in self.buckets if size >= n)

    def fits(self, n: int, context: Context) -> bool:
        """Whether a step of n new tokens with this (host-side) context can replay a graph."""
        return n <= self.buckets[-1] and context.block_tables.shape[1] <= self.block_tables.shape[1]

    def _upload(self, dst, src):
        """dst[:len(src)] = src, without stalling the stream: a copy from pageable host memory makes
        CUDA wait for all queued work first (the step launched ahead by async scheduling), one from
        pinned memory does not. torch's pinned-memory cache keeps the staging block until the copy
        has run."""
        if self._pinned and src.device.type == "cpu":
            src = src.pin_memory()
        dst[: len(src)].copy_(src, non_blocking=True)

    def _copy_tokens(self, rows, input_ids, positions, context):
        n = len(input_ids)
        self._upload(self.input_ids, input_ids)
        self._upload(self.positions, positions)
        self._upload(self.slot_mapping, context.slot_mapping)
        self.slot_mapping[n:rows].fill_(-1)  # stale slots would overwrite other sequences' cache
        # the step's columns, and zeros past them (not a whole padded row from the host: at 256 sequences and
        # 8k tokens that is 0.5 MB to build and pin per step)
        tables = context.block_tables
        self._upload(self.block_tables[:, : tables.shape[1]], tables)
        self.block_tables[: len(tables), tables.shape[1] :].fill_(0)


class DecodeGraphs(_Graphs):
    """One token per sequence; padding sequences have length 0 (decode attention writes zeros)."""

    def __init__(self, model, max_batch, max_blocks_per_seq, hidden_size, dtype, device):
        buckets = batch_buckets(max_batch)
        b = buckets[-1]
        super().__init__(model, buckets, b, b, max_blocks_per_seq, hidden_size, dtype, device)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=device)

    def run(self, input_ids, positions, context):
        """Replay the smallest graph that holds the batch; returns hidden states [B, hidden]."""
        n = input_ids.shape[0]
        b = self._bucket(n)
        self._copy_tokens(b, input_ids, positions, context)
        self._upload(self.seq_lens, context.seq_lens)
        self.seq_lens[n:b].fill_(0)
        self.graphs[b].replay()
        return self.hidden[:n]

    def _context(self, b, warm_up):
        return Context(slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b],
                       seq_lens=self.seq_lens[:b], num_decodes=b)


class PrefillGraphs(_Graphs):
    """The prefill of ONE sequence (a whole prompt, or a chunk after cached context) of up to
    max_tokens tokens. The bucket's remaining rows form a second, padding sequence: its tokens
    write nowhere (slot -1), read keys of block 0 (its block-table row stays zero) and their
    output rows are dropped, so the real sequence's rows compute what an eager step does, by the kernels a
    capture allows: over an int8 cache a long eager prefill attends through a dequantized float copy
    (prefill_attention's via-float path, not capturable), a replay through the int8 Triton kernel, so the two
    agree within float rounding, not bit for bit.
    """

    def __init__(self, model, max_tokens, max_blocks_per_seq, hidden_size, dtype, device):
        buckets = token_buckets(max_tokens)
        t = buckets[-1]
        super().__init__(model, buckets, t, 2, max_blocks_per_seq, hidden_size, dtype, device)
        # seq_lens [2] and cu_seqlens_q [3] in one buffer, filled by one copy per step
        self.lengths = torch.zeros(5, dtype=torch.int32, device=device)

    def fits(self, n: int, context: Context) -> bool:
        return len(context.seq_lens) == 1 and super().fits(n, context)

    def run(self, input_ids, positions, context):
        """Replay the smallest graph that holds the step's n tokens; returns hidden states [n, hidden]."""
        n = input_ids.shape[0]
        t = self._bucket(n)
        self._copy_tokens(t, input_ids, positions, context)
        self.positions[n:t].fill_(0)  # padding rows: any position inside the RoPE table
        seq_len = int(context.seq_lens[0])
        self._upload(self.lengths, torch.tensor([seq_len, t - n, 0, n, t], dtype=torch.int32))
        self.graphs[t].replay()
        return self.hidden[:n]

    def _fill_for_capture(self, t):
        self.lengths.copy_(torch.tensor([t, 0, 0, t, t], dtype=torch.int32))  # one sequence of t tokens

    def _context(self, t, warm_up):
        # prefill_attention memoizes its tile map per cu_seqlens_q tensor: the warm-up gets a copy,
        # so the captured graph computes the map itself instead of reusing the warm-up's tensors
        cu = self.lengths[2:].clone() if warm_up else self.lengths[2:]
        return Context(slot_mapping=self.slot_mapping[:t], block_tables=self.block_tables,
                       seq_lens=self.lengths[:2], cu_seqlens_q=cu)
