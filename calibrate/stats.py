"""Activation statistics of one decoder layer: per-input-channel absmax of every Linear input.

`collect_layer_stats` pushes the calibration hidden states (float32, on the calibration device) through a layer in
batches, with a forward pre-hook on every nn.Linear. Each hook keeps the running absmax of
its input per channel over all calibration tokens, and copies the inputs of a fixed, evenly
spread subset of tokens (`sample_tokens` of them), on which smoothing choices are measured.
It returns the stats and the layer's outputs (the next layer's inputs).
"""

from dataclasses import dataclass, field

import torch

from eightbit.quant.errors import QuantizeError


@dataclass
class LayerStats:
    absmax: dict[str, torch.Tensor] = field(default_factory=dict)  # Linear name -> [in] float32
    samples: dict[str, torch.Tensor] = field(default_factory=dict)  # Linear name -> [n, in] float32


def sample_token_index(num_tokens: int, sample_tokens: int) -> torch.Tensor:
    """Evenly spread flat token indices, at most sample_tokens of them."""
    n = min(num_tokens, sample_tokens)
    return torch.linspace(0, num_tokens - 1, n).round().long().unique()


@torch.no_grad()
def collect_layer_stats(
    layer: torch.nn.Module,
    run_layer,
    hidden: torch.Tensor,
    *,
    sample_tokens: int = 2048,
    batch_size: int = 8,
    layer_name: str = "layer",
) -> tuple[LayerStats, torch.Tensor]:
    """hidden [N, T, H] float32 -> (stats of every Linear's input, outputs [N, T, H] float32).

    run_layer(layer, x [B, T, H]) -> [B, T, H] runs the layer as the model does (RoPE, causal mask).
    NaN or inf in an input or in the output is a QuantizeError naming where it appeared.
    """
    n, t, _ = hidden.shape
    index = sample_token_index(n * t, sample_tokens)
    stats = LayerStats()
    chunks = {}  # name -> list of sampled rows
    state = {"lo": 0, "hi": 0}

    def hook_for(name):
        def hook(module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            amax = x.abs().amax(dim=0)
            if not torch.isfinite(amax).all():
                raise QuantizeError(f"{layer_name}.{name}: the calibration activations hold NaN or inf")
            prev = stats.absmax.get(name)
            stats.absmax[name] = amax if prev is None else torch.maximum(prev, amax)
            lo, hi = state["lo"], state["hi"]
            sel = index[(index >= lo) & (index < hi)] - lo
            if len(sel):
                chunks.setdefault(name, []).append(x[sel].clone())

        return hook

    handles = [
        m.register_forward_pre_hook(hook_for(name))
        for name, m in layer.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    outputs = torch.empty_like(hidden)
    try:
        for b in range(0, n, batch_size):
            x = hidden[b: b + batch_size]
            state["lo"], state["hi"] = b * t, (b + x.shape[0]) * t
            y = run_layer(layer, x)
            if not torch.isfinite(y).all():
                raise QuantizeError(f"{layer_name}: the layer's output on the calibration text holds NaN or inf")
            outputs[b: b + batch_size] = y
    finally:
        for h in handles:
            h.remove()
    stats.samples = {name: torch.cat(rows) for name, rows in chunks.items()}
    return stats, outputs
