"""The attention metadata of the current step, so model forwards stay `forward(input_ids, positions)`.

The model runner sets it before the forward and resets it after; the attention
layers read it. Keeping it out of the call signatures lets the same forward run
eagerly and under a CUDA graph (whose captured tensors are these, refilled in place).
It is kept per thread: engines stepped in different threads of one process (a server's
engine thread beside an offline `LLM`) would otherwise run on each other's metadata.
"""

import threading
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class Context:
    """A step's B sequences, their new tokens packed back to back (T rows). The first num_decodes
    sequences have one new token each and run through decode attention; the rest (a mixed or a
    prefill step) through prefill attention."""

    slot_mapping: torch.Tensor | None = None  # [T] int64 cache slot of each new token
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    seq_lens: torch.Tensor | None = None  # [B] int32 context length after this step
    # [B - num_decodes + 1] int32 offsets of the prefill sequences' new tokens, from row num_decodes
    cu_seqlens_q: torch.Tensor | None = None
    num_decodes: int = 0
    # host int: block-table entries the prefill sequences use (their longest table); None = the whole width
    prefill_width: int | None = None

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one new token."""
        return self.seq_lens is not None and self.num_decodes == len(self.seq_lens)

    # A mixed step's two parts, as views made once per step: the kernels build per-step work (the decode's work
    # order, the prefill's tile map) once and reuse it while every layer passes them the same tensors.
    @cached_property
    def decode_part(self):
        """(block_tables, seq_lens) of the one-token sequences."""
        nd = self.num_decodes
        return self.block_tables[:nd], self.seq_lens[:nd]

    @cached_property
    def prefill_part(self):
        """(block_tables, seq_lens) of the prefill sequences; only their columns of the table: its width tells
        the kernels their longest context."""
        nd = self.num_decodes
        return self.block_tables[nd:, :self.prefill_width], self.seq_lens[nd:]


class _ThreadContext(threading.local):
    def __init__(self):
        self.context = Context()


_current = _ThreadContext()


def get_context() -> Context:
    return _current.context


def set_context(context: Context):
    _current.context = context


def reset_context():
    set_context(Context())
