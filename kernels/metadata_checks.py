"""Range checks of the paged-attention metadata, on when EIGHTBIT_CHECK_METADATA=1 (or ENABLED = True).

The kernels trust slot mappings, block tables, sequence lengths, query offsets and positions: a value out of range
reads or writes past a tensor, and the plain-torch reference may cut it silently (a seq_len past its block table
attends to the table's keys only). The engine builds them itself, so the checks are off by default: each reads the
metadata back to the host, a synchronization per call. Turn them on to debug a caller of the kernels; both backends
run them (kernels/checks.py). CUDA-graph replays are not checked (the engine's enforce_eager runs every step
eagerly)."""

import os

import torch

ENABLED = os.environ.get("EIGHTBIT_CHECK_METADATA", "0") == "1"


def active(device) -> bool:
    """On, and not inside CUDA-graph capture (a check reads back to the host, which capture forbids; a graph's
    replays are not checked: run with enforce_eager to check every step)."""
    return ENABLED and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _first(bad):
    return tuple(int(i) for i in bad.nonzero()[0])


def check_tables(block_tables, seq_lens, num_blocks, block_size, name):
    """Every sequence fits its table's width, and every block it uses is a block of the cache."""
    width = block_tables.shape[1]
    lens = seq_lens.long()
    bad = (lens < 0) | (lens > width * block_size)
    if bad.any():
        (b,) = _first(bad)
        raise ValueError(f"{name}: seq_lens[{b}] = {int(lens[b])} is outside 0..{width * block_size} "
                         f"(block_tables has {width} columns of {block_size} keys)")
    used = torch.arange(width, device=block_tables.device)[None, :] < (lens[:, None] + block_size - 1) // block_size
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bad.any():
        b, j = _first(bad)
        raise ValueError(f"{name}: block_tables[{b}, {j}] = {int(block_tables[b, j])} is not a block of the cache "
                         f"(0..{num_blocks - 1}), and sequence {b} uses it")


def check_queries(cu_seqlens_q, seq_lens, num_tokens, name):
    """Query offsets rise from 0 to at most the query rows, and no sequence has more queries than keys."""
    cu = cu_seqlens_q.long()
    n_q = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((n_q < 0).any()) or int(cu[-1]) > num_tokens:
        raise ValueError(f"{name}: cu_seqlens_q must rise from 0 to at most {num_tokens} (q's rows), got "
                         f"{cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}")
    bad = n_q > seq_lens.long()
    if bad.any():
        (b,) = _first(bad)
        raise ValueError(f"{name}: sequence {b} has {int(n_q[b])} queries but seq_len {int(seq_lens[b])}")


def check_slots(slot_mapping, num_slots, name):
    """Every slot is -1 (do not store) or a slot of the cache."""
    bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
    if bad.any():
        (t,) = _first(bad)
        raise ValueError(f"{name}: slot_mapping[{t}] = {int(slot_mapping[t])} is outside -1..{num_slots - 1}")


def check_positions(positions, max_pos, name):
    bad = (positions < 0) | (positions >= max_pos)
    if bad.any():
        (t,) = _first(bad)
        raise ValueError(f"{name}: positions[{t}] = {int(positions[t])} is outside the rotary cache's 0..{max_pos - 1}")
