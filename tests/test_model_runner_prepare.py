"""ModelRunner._prepare (numpy over the batch) against a per-token plain-Python reference, on random steps of a real
BlockManager: new prompts with prefix-cache hits, prompt chunks starting mid-prompt, mixed steps, forks with
copy-on-write, frees and restarts."""

import random

import pytest
import torch

from eightbit.engine.block_manager import BlockManager
from eightbit.engine.model_runner import ModelRunner


class Seq:
    def __init__(self, seq_id, token_ids, num_computed_tokens=0):
        self.seq_id, self.token_ids, self.num_computed_tokens = seq_id, token_ids, num_computed_tokens

    @property
    def num_tokens(self):
        return len(self.token_ids)


def reference_inputs(bm, bs, scheduled, continuation):
    """What a step's inputs are, token by token: each new token's id, position and cache slot (its block from the
    sequence's table), each sequence's length after the step, the prefill sequences' query offsets, the tables
    zero-padded to the longest, and the rows that sample (a sequence's last new token, once its prompt is done)."""
    ids, positions, slots, lens, rows, samplers = [], [], [], [], [], []
    tables = [bm.block_table(seq.seq_id) for seq, _ in scheduled]
    for (seq, n), table in zip(scheduled, tables):
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        lens.append(seq.num_computed_tokens + n)
        if continuation or lens[-1] == seq.num_tokens:
            rows.append(len(positions) - 1)
            samplers.append(seq)
    nd = sum(1 for _, n in scheduled if n == 1)  # the one-token sequences come first
    offsets = [0]
    for _, n in scheduled[nd:]:
        offsets.append(offsets[-1] + n)
    width = max(map(len, tables))
    return dict(ids=ids, positions=positions, slots=slots, tables=[t + [0] * (width - len(t)) for t in tables],
                lens=lens, offsets=offsets, nd=nd, prefill_width=max(map(len, tables[nd:]), default=0), rows=rows,
                samplers=samplers)


def prepared(runner, scheduled, input_tokens=None):
    ids, pos, ctx, rows, samplers = runner._prepare(scheduled, input_tokens)
    dtypes = (pos.dtype, ctx.slot_mapping.dtype, ctx.block_tables.dtype, ctx.seq_lens.dtype, ctx.cu_seqlens_q.dtype,
              rows.dtype)
    assert dtypes == (torch.int64, torch.int64, torch.int32, torch.int32, torch.int32, torch.int64)
    return dict(ids=ids.tolist(), positions=pos.tolist(), slots=ctx.slot_mapping.tolist(),
                tables=ctx.block_tables.tolist(), lens=ctx.seq_lens.tolist(), offsets=ctx.cu_seqlens_q.tolist(),
                nd=ctx.num_decodes, prefill_width=ctx.prefill_width, rows=rows.tolist(), samplers=samplers)


def make_runner(bm, bs):
    runner = ModelRunner(model=None, block_size=bs, device="cpu")
    runner.block_manager = bm
    return runner


@pytest.mark.parametrize("seed", range(40))
def test_prepare_matches_the_reference_on_random_steps(seed):
    rng, bs = random.Random(seed), 4
    bm = BlockManager(300, bs, enable_prefix_caching=True, max_blocks_per_seq=40)
    runner, live, next_id = make_runner(bm, bs), [], 0
    for _ in range(25):
        for _ in range(rng.randint(0, 2)):  # new prompts over a 4-token alphabet: prefix hits are common
            seq = Seq(next_id, [rng.randint(0, 3) for _ in range(rng.randint(1, 30))])
            next_id += 1
            cached = bm.allocate(seq.seq_id, seq.token_ids)
            if cached is not None:
                seq.num_computed_tokens = cached
                live.append(seq)
        if live and rng.random() < 0.2:  # a fork shares every block: its next write copies the last one
            parent = rng.choice(live)
            child = Seq(next_id, list(parent.token_ids), parent.num_computed_tokens)
            next_id += 1
            bm.fork(parent.seq_id, child.seq_id)
            live.append(child)
        if live and rng.random() < 0.2:
            bm.free(live.pop(rng.randrange(len(live))).seq_id)
        scheduled = []
        for seq in live:
            if seq.num_computed_tokens == seq.num_tokens:
                if seq.num_tokens >= 150:
                    continue
                seq.token_ids.append(rng.randint(0, 3))  # its sampled token
            n = rng.randint(1, seq.num_tokens - seq.num_computed_tokens)
            if bm.append_slots(seq.seq_id, seq.num_computed_tokens + n) is not None:
                scheduled.append((seq, n))
        if not scheduled:
            continue
        scheduled.sort(key=lambda item: item[1] != 1)  # as ModelRunner.run orders a step
        assert prepared(runner, scheduled) == reference_inputs(bm, bs, scheduled, continuation=False)
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            bm.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)


def test_prepare_of_a_continuation_takes_the_device_tokens_and_samples_every_row():
    bs = 4
    bm = BlockManager(16, bs, max_blocks_per_seq=8)
    runner = make_runner(bm, bs)
    seqs = [Seq(0, list(range(7)), 7), Seq(1, list(range(4)), 4)]  # their sampled tokens not appended yet
    for seq in seqs:
        bm.allocate(seq.seq_id, seq.token_ids)
        bm.append_slots(seq.seq_id, seq.num_tokens + 1)
    scheduled = [(seq, 1) for seq in seqs]
    tokens = torch.tensor([11, 12])
    ids, pos, ctx, rows, samplers = runner._prepare(scheduled, tokens)
    assert ids is tokens and pos.tolist() == [7, 4] and rows.tolist() == [0, 1] and samplers == seqs
    t0, t1 = bm.block_table(0), bm.block_table(1)
    assert ctx.slot_mapping.tolist() == [t0[1] * bs + 3, t1[1] * bs + 0]  # position 7 in block 1, 4 in block 1
    assert ctx.block_tables.tolist() == [t0, t1] and ctx.seq_lens.tolist() == [8, 5]
    assert ctx.num_decodes == 2 and ctx.cu_seqlens_q.tolist() == [0] and ctx.prefill_width == 0


def test_prepare_refuses_a_one_token_sequence_after_a_longer_one():
    """The context's decode part is its first num_decodes rows: unsorted, a prefill row would be read as a decode."""
    bs = 4
    bm = BlockManager(16, bs, max_blocks_per_seq=8)
    runner = make_runner(bm, bs)
    seqs = [Seq(0, list(range(5))), Seq(1, list(range(3)), 2)]
    for seq in seqs:
        bm.allocate(seq.seq_id, seq.token_ids)
        bm.append_slots(seq.seq_id, seq.num_tokens)
    with pytest.raises(ValueError, match="one-token sequences first"):
        runner._prepare([(seqs[0], 5), (seqs[1], 1)])
    assert prepared(runner, [(seqs[1], 1), (seqs[0], 5)])["nd"] == 1
