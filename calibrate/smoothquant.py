"""SmoothQuant for Llama-family decoder layers: move activation outliers into the weights.

For a Linear input x [.., K] with per-channel factors s [K]:  y = x W^T = (x / s)(W * s)^T.
x / s is folded exactly into whatever produces x, so nothing is added at run time:

    point     quantized input of             producer that absorbs 1/s
    qkv       q_proj, k_proj, v_proj         input_layernorm.weight
    gate_up   gate_proj, up_proj             post_attention_layernorm.weight
    o         o_proj                         v_proj rows (+ bias): attention output is linear in v
    down      down_proj                      up_proj rows (+ bias): SiLU(gate) * up is linear in up

With GQA, o_proj input channel (query head h, dim d) is a mix of v head h // group, dim d,
so the o factors are chosen per v channel, from the max over the query heads of its group,
and repeated over the group.

    s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha)

alpha is chosen per layer and per point from a grid by the measured output error of the
W8A8 linear (per-token int8 x, per-channel int8 W, simulated in float32) against the float
output, on calibration inputs; "no smoothing" is always a candidate, so smoothing never
makes the measured error worse.
"""

from dataclasses import dataclass

import torch

from eightbit.quant.int8 import quantize_per_channel, quantize_per_token

# 0.05 .. 1.0 in steps of 0.05. On SmolLM2 this grid measured W8A8+KV8 +0.93% on full WikiText-2,
# the coarser (0.3, 0.4, .., 0.8, 0.85, 0.9, 0.95) +1.10% with the same calibration (docs/evals.md).
ALPHA_GRID = tuple(round(0.05 * i, 2) for i in range(1, 21))
S_MIN, S_MAX = 1e-5, 1e5


@dataclass(frozen=True)
class SmoothPoint:
    name: str
    consumers: tuple[str, ...]  # Linear names (relative to the decoder layer) sharing this input
    producer: str  # module absorbing 1/s: an RMSNorm (its weight) or a Linear (its output rows)
    grouped: bool = False  # o_proj: factors shared across the query heads of a KV group


POINTS = (
    SmoothPoint("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
    SmoothPoint("gate_up", ("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
    SmoothPoint("o", ("self_attn.o_proj",), "self_attn.v_proj", grouped=True),
    SmoothPoint("down", ("mlp.down_proj",), "mlp.up_proj"),
)


def smoothing_factors(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = act^alpha / w^(1-alpha), per channel; channels that never fire get s = 1."""
    a = act_absmax.float().clamp(min=S_MIN)
    w = weight_absmax.float().clamp(min=S_MIN)
    s = (a.pow(alpha) / w.pow(1 - alpha)).clamp(S_MIN, S_MAX)
    return torch.where(act_absmax > 0, s, torch.ones_like(s))


def _group_max(v: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """[Hq * D] -> [Hkv * D]: max over the query heads sharing each KV head."""
    d = v.shape[0] // num_heads
    return v.view(num_kv_heads, num_heads // num_kv_heads, d).amax(dim=1).flatten()


def _expand_groups(s_kv: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """[Hkv * D] -> [Hq * D]: query head h takes the factors of KV head h // group."""
    d = s_kv.shape[0] // num_kv_heads
    return s_kv.view(num_kv_heads, 1, d).expand(num_kv_heads, num_heads // num_kv_heads, d).flatten()


def weight_absmax(weights) -> torch.Tensor:
    """Per input channel absmax over the rows of all the consumers' weights."""
    return torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)


def point_factors(point, weights, act_absmax, alpha, num_heads, num_kv_heads, w_absmax=None):
    """(s for the consumers' input channels [K], s for the producer [K or Hkv*D])."""
    if w_absmax is None:
        w_absmax = weight_absmax(weights)
    if not point.grouped:
        s = smoothing_factors(act_absmax, w_absmax, alpha)
        return s, s
    s_kv = smoothing_factors(
        _group_max(act_absmax, num_heads, num_kv_heads), _group_max(w_absmax, num_heads, num_kv_heads), alpha
    )
    return _expand_groups(s_kv, num_heads, num_kv_heads), s_kv


def fake_w8a8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, K] @ w [N, K]^T with x per-token and w per-channel int8, simulated in float32."""
    xq, xs = quantize_per_token(x)
    wq, ws = quantize_per_channel(w)
    return (xq.float() @ wq.float().t()).mul_(xs).mul_(ws.view(1, -1))


class W8A8Error:
    """Sum over consumers of ||W8A8 output - float output||^2 / ||float output||^2 on samples x.

    The float reference and the concatenated weights are computed once; each call with
    factors s (None: no smoothing) quantizes x / s per token and W * s per channel."""

    def __init__(self, x: torch.Tensor, weights: list):
        self.x = x.float()
        self.w = torch.cat([wi.float() for wi in weights])
        ref = self.x @ self.w.t()
        self.bounds = []
        start = 0
        for wi in weights:
            stop = start + wi.shape[0]
            self.bounds.append((start, stop, ref[:, start:stop].pow(2).sum().clamp(min=1e-30).item()))
            start = stop
        self.ref = ref

    def __call__(self, s: torch.Tensor | None = None) -> float:
        out = fake_w8a8(self.x, self.w) if s is None else fake_w8a8(self.x / s, self.w * s)
        diff = out.sub_(self.ref).pow_(2)
        return sum(diff[:, a:b].sum().item() / norm for a, b, norm in self.bounds)


def w8a8_error(x: torch.Tensor, weights: list, s: torch.Tensor | None = None) -> float:
    """W8A8Error(x, weights)(s), for one-off use."""
    return W8A8Error(x, weights)(s)


def choose_alpha(point, weights, act_absmax, samples, alphas, num_heads, num_kv_heads):
    """Try no smoothing and each alpha on the samples; return (the best alpha or None for no smoothing, its error,
    the error unsmoothed)."""
    error = W8A8Error(samples, weights)
    w_absmax = weight_absmax(weights)
    base = error()
    best_alpha, best_err = None, base
    for alpha in alphas:
        s, _ = point_factors(point, weights, act_absmax, alpha, num_heads, num_kv_heads, w_absmax)
        err = error(s)
        if err < best_err:
            best_alpha, best_err = alpha, err
    return best_alpha, best_err, base


@torch.no_grad()
def fold(layer: torch.nn.Module, point: SmoothPoint, s_in: torch.Tensor, s_producer: torch.Tensor) -> None:
    """Fold factors into a layer in place: consumers' weight columns *= s_in, producer /= s_producer."""
    for name in point.consumers:
        lin = layer.get_submodule(name)
        lin.weight.mul_(s_in.to(lin.weight.dtype))
    prod = layer.get_submodule(point.producer)
    s = s_producer.to(prod.weight.dtype)
    if isinstance(prod, torch.nn.Linear):
        prod.weight.div_(s.unsqueeze(1))
        if prod.bias is not None:
            prod.bias.div_(s)
    else:  # RMSNorm: y = norm(x) * weight
        if getattr(prod, "bias", None) is not None:
            prod.bias.div_(s)
        prod.weight.div_(s)


@torch.no_grad()
def smooth_layer(layer, stats, alpha, num_heads: int, num_kv_heads: int, alpha_grid=ALPHA_GRID) -> dict:
    """Choose and fold the four smoothing points of one decoder layer.

    alpha: "auto" (search alpha_grid), a float (used everywhere) or None (no smoothing, errors
    still measured). Returns {point: {"alpha", "error", "error_unsmoothed"}} (relative errors).
    """
    if alpha == "auto":
        alphas = tuple(alpha_grid)
    elif alpha is None:
        alphas = ()
    else:
        alphas = (float(alpha),)
    record = {}
    for point in POINTS:
        weights = [layer.get_submodule(n).weight for n in point.consumers]
        act = stats.absmax[point.consumers[0]]
        samples = stats.samples[point.consumers[0]]
        if alpha == "auto" or alpha is None:
            chosen, err, base = choose_alpha(point, weights, act, samples, alphas, num_heads, num_kv_heads)
        else:  # a fixed alpha is applied even where it measures worse
            chosen = alphas[0]
            s, _ = point_factors(point, weights, act, chosen, num_heads, num_kv_heads)
            error = W8A8Error(samples, weights)
            err, base = error(s), error()
        if chosen is not None:
            s_in, s_prod = point_factors(point, weights, act, chosen, num_heads, num_kv_heads)
            fold(layer, point, s_in, s_prod)
        record[point.name] = {"alpha": chosen, "error": err, "error_unsmoothed": base}
    return record
