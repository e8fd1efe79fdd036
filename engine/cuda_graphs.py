"""Steps replayed as CUDA graphs: decode steps per batch-size bucket, short prefills per token bucket, and steps
no one graph takes (decodes beside prefill sequences, or several prefill sequences) as one replay per part
(ModelRunner._run_split_graphs).

Run eagerly, a step costs one Python-level launch per kernel (~11 per layer), so a decode
step or a short prefill is bound by the host, not the GPU (Llama-3-8B, a 512-token prompt:
~11 ms of kernels in a ~20 ms eager step). A graph replays the whole forward with one
launch. The graphs read their inputs from static buffers: a step copies its inputs in,
pads up to the bucket with rows that write nowhere (cache slot -1) and replays. All graphs
share one memory pool (their replays never overlap), captured largest first.

A step uploads its inputs with one copy (and its block tables with a second), and a decode graph
computes the logits too: for a small model the host's work per step can set its pace (Llama-3.2-1B
at batch 1 on an H200: 0.42-0.83 ms of host work against 0.78 ms of GPU work), and each launch or
copy left outside the graph cost it 10-80 us (docs/benchmarks/engine.md, run 73).
"""

import numpy as np
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

    def __init__(self, model, buckets, rows, num_lengths, table_rows, table_width, hidden_size, dtype, device):
        self.model = model
        self.buckets = buckets
        # The per-token inputs and the int32 lengths in one buffer, so that a step uploads them with one copy:
        # input ids | positions | slot mapping (int64, `width` each, 64-byte aligned) | lengths (int32).
        self._width = width = -(-rows // 8) * 8
        self.inputs = torch.zeros(3 * width + -(-num_lengths // 2), dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping = (v[:rows] for v in self.inputs[: 3 * width].view(3, width))
        self.lengths = self.inputs[3 * width :].view(torch.int32)[:num_lengths]
        self.slot_mapping.fill_(-1)  # the captures' steps write nowhere
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

    def _upload(self, n, input_ids, positions, context, lengths):
        """Copy the step's n tokens in, padded to the buffers' rows (position 0, slot -1: padding writes nowhere),
        with its int32 lengths (the rest zero), in one copy; then its block tables.

        The copies come from pinned memory: one from pageable host memory makes CUDA wait for all queued work
        first (the step launched ahead by async scheduling), one from pinned memory does not. torch's
        pinned-memory cache keeps the staging block until the copy has run. input_ids on the device (a
        continuation's sampled tokens) are copied after the rest."""
        host = torch.empty(self.inputs.shape, dtype=torch.int64, pin_memory=self._pinned)
        packed = host.numpy()
        ids, pos, slots = packed[: 3 * self._width].reshape(3, self._width)
        on_host = input_ids.device.type == "cpu"
        ids[:] = 0
        if on_host:
            ids[:n] = input_ids.numpy()
        pos[:n], pos[n:] = positions.numpy(), 0
        slots[:n], slots[n:] = context.slot_mapping.numpy(), -1
        tail = packed[3 * self._width :].view(np.int32)
        tail[:] = 0
        tail[: len(lengths)] = lengths
        self.inputs.copy_(host, non_blocking=True)
        if not on_host:
            self.input_ids[:n].copy_(input_ids)
        # the step's columns, and zeros past them (not a whole padded row from the host: at 256 sequences and
        # 8k tokens that is 0.5 MB to build and pin per step)
        tables = context.block_tables
        self.block_tables[: len(tables), : tables.shape[1]].copy_(tables.pin_memory() if self._pinned else tables,
                                                                  non_blocking=True)
        self.block_tables[: len(tables), tables.shape[1] :].fill_(0)


class DecodeGraphs(_Graphs):
    """One token per sequence; padding sequences have length 0 (decode attention writes zeros). The graph
    computes the logits of every row too."""

    def __init__(self, model, max_batch, max_blocks_per_seq, hidden_size, dtype, device):
        buckets = batch_buckets(max_batch)
        b = buckets[-1]
        # lengths: each sequence's context length (seq_lens)
        super().__init__(model, buckets, b, b, b, max_blocks_per_seq, hidden_size, dtype, device)
        self.logits = torch.zeros(b, model.config.vocab_size, dtype=torch.float32, device=device)

    def run(self, input_ids, positions, context):
        """Replay the smallest graph that holds the batch; returns hidden states [B, hidden] and float32
        logits [B, vocab]."""
        n = input_ids.shape[0]
        self._upload(n, input_ids, positions, context, context.seq_lens.numpy())
        self.graphs[self._bucket(n)].replay()
        return self.hidden[:n], self.logits[:n]

    def _forward(self, rows):
        super()._forward(rows)
        self.model.compute_logits(self.hidden[:rows], out=self.logits[:rows])

    def _context(self, b, warm_up):
        return Context(slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b],
                       seq_lens=self.lengths[:b], num_decodes=b)


class PrefillGraphs(_Graphs):
    """The prefill of up to max_seqs sequences (whole prompts, or chunks after cached context) of up to max_tokens
    new tokens in all. The bucket's remaining rows form one more, padding sequence: its tokens write nowhere (slot
    -1), read keys of block 0 (its block-table row stays zero) and their output rows are dropped; the sequence
    slots a step leaves unused are empty (no new tokens, length 0), so no attention tile reads their block-table
    rows, which keep an earlier step's entries (clearing them would add a copy to every replay). So the real
    sequences' rows compute what an eager step does, by the kernels a capture allows: over an int8 cache a long
    eager prefill attends through a dequantized float copy (prefill_attention's via-float path, not capturable), a
    replay through the int8 Triton kernel, so the two agree within float rounding, not bit for bit.
    """

    def __init__(self, model, max_tokens, max_seqs, max_blocks_per_seq, hidden_size, dtype, device):
        buckets = token_buckets(max_tokens)
        t = buckets[-1]
        self.max_seqs = max_seqs
        # lengths: seq_lens [max_seqs + 1] and cu_seqlens_q [max_seqs + 2] (the last sequence pads)
        super().__init__(model, buckets, t, 2 * max_seqs + 3, max_seqs + 1, max_blocks_per_seq, hidden_size, dtype,
                         device)

    def fits(self, n: int, context: Context) -> bool:
        return context.num_decodes == 0 and len(context.seq_lens) <= self.max_seqs and super().fits(n, context)

    def run(self, input_ids, positions, context):
        """Replay the smallest graph that holds the step's n tokens; returns hidden states [n, hidden] and None
        (no logits: the step's caller computes those of the rows it needs)."""
        n, b, s = input_ids.shape[0], len(context.seq_lens), self.max_seqs
        t = self._bucket(n)
        empty = s - b
        lengths = np.concatenate([context.seq_lens.numpy(), np.zeros(empty, np.int32), [t - n],
                                  context.cu_seqlens_q.numpy(), np.full(empty, n, np.int32), [t]]).astype(np.int32)
        self._upload(n, input_ids, positions, context, lengths)
        self.graphs[t].replay()
        return self.hidden[:n], None

    def _fill_for_capture(self, t):
        # one sequence of t tokens; the other slots empty, the padding sequence too
        s = self.max_seqs
        seq_lens = [t] + [0] * s
        cu = [0] + [t] * (s + 1)
        self.lengths.copy_(torch.tensor(seq_lens + cu, dtype=torch.int32))

    def _context(self, t, warm_up):
        # prefill_attention memoizes its tile map per cu_seqlens_q tensor: the warm-up gets a copy,
        # so the captured graph computes the map itself instead of reusing the warm-up's tensors
        s = self.max_seqs + 1
        cu = self.lengths[s:].clone() if warm_up else self.lengths[s:]
        return Context(slot_mapping=self.slot_mapping[:t], block_tables=self.block_tables,
                       seq_lens=self.lengths[:s], cu_seqlens_q=cu)
