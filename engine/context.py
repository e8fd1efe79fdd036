"""The attention metadata of the current step, so model forwards stay `forward(input_ids, positions)`.

The model runner sets it before the forward and resets it after; the attention
layers read it. Keeping it out of the call signatures lets the same forward run
eagerly and under a CUDA graph (whose captured tensors are these, refilled in place).
"""

from dataclasses import dataclass

import torch


@dataclass
class Context:
    is_decode: bool = False  # every sequence has exactly one new token
    slot_mapping: torch.Tensor | None = None  # [T] int64 cache slot of each new token
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    seq_lens: torch.Tensor | None = None  # [B] int32 context length after this step
    cu_seqlens_q: torch.Tensor | None = None  # [B + 1] int32 offsets of each sequence's new tokens


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(context: Context):
    global _CONTEXT
    _CONTEXT = context


def reset_context():
    set_context(Context())
