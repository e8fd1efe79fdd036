"""Decode steps replayed as CUDA graphs, one per batch-size bucket.

A decode step launches a few kernels per layer on tiny tensors, so on the GPU its
cost is launch overhead unless the whole forward is one graph. The graphs read
their inputs from static buffers; a step copies its inputs in, pads the batch up to
the next bucket (padding rows write nowhere: slot -1, length 0) and replays.
All buckets share one memory pool, captured largest first.
"""

import torch

from eightbit.engine.context import Context, reset_context, set_context


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({min(s, max_batch) for s in sizes})


class DecodeGraphs:
    def __init__(self, model, max_batch, max_blocks_per_seq, hidden_size, dtype, device):
        self.model = model
        self.buckets = batch_buckets(max_batch)
        b = self.buckets[-1]
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(b, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(b, hidden_size, dtype=dtype, device=device)
        self.graphs = {}

    @torch.inference_mode()
    def capture(self):
        pool = None
        for b in reversed(self.buckets):
            set_context(self._context(b))
            try:
                self.hidden[:b] = self.model(self.input_ids[:b], self.positions[:b])  # warm-up: compile, allocate
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.hidden[:b] = self.model(self.input_ids[:b], self.positions[:b])
            finally:
                reset_context()
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.buckets[-1] and width <= self.block_tables.shape[1]

    def run(self, input_ids, positions, slot_mapping, block_tables, seq_lens):
        """Replay the smallest graph that holds the batch; returns hidden states [B, hidden]."""
        n = input_ids.shape[0]
        b = next(size for size in self.buckets if size >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[n:b].fill_(-1)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.seq_lens[n:b].fill_(0)
        self.block_tables[:n, : block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        self.graphs[b].replay()
        return self.hidden[:n]

    def _context(self, b):
        return Context(is_decode=True, slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b],
                       seq_lens=self.seq_lens[:b])
