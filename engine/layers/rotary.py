"""The RoPE cos/sin table, computed with transformers' own frequency code so every scaling type matches HF."""

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


def check_rope_type(config) -> None:
    kind = rope_type(config)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE scaling {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def cos_sin_cache(config, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half of the columns, sin in the second."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    check_rope_type(config)
    rope = LlamaRotaryEmbedding(config)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, rope.inv_freq.float())
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * rope.attention_scaling
