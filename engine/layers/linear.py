"""Linear layers whose weight is either float or int8 per output channel (W8A8).

A W8A8 layer takes its input already quantized (an `Int8Activation` from a fused
norm or SiLU kernel) or quantizes it per token itself, then runs one int8 GEMM
with the dequantization fused into its epilogue. Fused layers (q|k|v, gate|up)
are one Linear whose rows are filled shard by shard at load time.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from eightbit.kernels import ops
from eightbit.quant.int8 import quantize_per_channel


class Int8Activation(NamedTuple):
    q: torch.Tensor  # [M, K] int8
    scale: torch.Tensor  # [M, 1] float32


class Linear(nn.Module):
    def __init__(self, in_features, out_features, bias=False, shards=None, quantized=False, dtype=torch.bfloat16):
        """shards: {shard_id: size} in row order for a fused layer, e.g. {"q": 576, "k": 192, "v": 192}."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quantized = quantized
        self.out_dtype = dtype
        self.shard_offsets = {}
        offset = 0
        for shard_id, size in (shards or {}).items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        if shards and offset != out_features:
            raise ValueError(f"shard sizes add up to {offset}, not out_features={out_features}")
        weight_dtype = torch.int8 if quantized else dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=weight_dtype), requires_grad=False)
        self.weight_scale = (
            nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32), requires_grad=False) if quantized else None
        )
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        # a W8A8 layer built for a float checkpoint (quantization="w8a8"): load() quantizes each float weight as it
        # arrives, from the checkpoint's own precision (a bf16 copy first would round twice)
        self.quantize_on_load = False

    def forward(self, x):
        if not self.quantized:
            return F.linear(x, self.weight, self.bias)
        if not isinstance(x, Int8Activation):
            x = Int8Activation(*ops.quant_per_token(x))
        return ops.int8_gemm(x.q, x.scale, self.weight, self.weight_scale, self.bias, self.out_dtype)

    def load(self, param_name: str, tensor: torch.Tensor, shard_id=None) -> tuple[str, ...]:
        """Copy a checkpoint tensor ("weight", "weight_scale" or "bias") into place, or into its shard's rows.
        Returns the parameters it filled: with quantize_on_load a float weight fills weight and weight_scale."""
        param = getattr(self, param_name) if param_name in ("weight", "weight_scale", "bias") else None
        if param is None:
            raise ValueError(f"unexpected tensor {param_name!r} for a {'W8A8' if self.quantized else 'float'} linear")
        param = self._rows(param, shard_id)
        if param_name == "weight_scale" and tensor.dim() == 1:  # [N] and [N, 1] both occur
            tensor = tensor.unsqueeze(1)
        if tensor.shape != param.shape:
            raise ValueError(f"{param_name}{'' if shard_id is None else f'[{shard_id}]'}: checkpoint shape "
                             f"{tuple(tensor.shape)} does not match the model's {tuple(param.shape)}")
        if self.quantize_on_load and param_name == "weight" and tensor.is_floating_point():
            # per output channel, so a shard's rows quantize as they would in the whole matrix
            q, scale = quantize_per_channel(tensor.to(param.device))
            param.copy_(q)
            self._rows(self.weight_scale, shard_id).copy_(scale)
            return ("weight", "weight_scale")
        if self.quantized and param_name == "weight" and tensor.dtype != torch.int8:
            raise ValueError(f"W8A8 weight must be int8, the checkpoint has {tensor.dtype}")
        if param.is_floating_point() and not tensor.is_floating_point():
            raise ValueError(f"{param_name} must be a float tensor, the checkpoint has {tensor.dtype}")
        if param_name == "weight_scale" and not torch.isfinite(tensor).all():
            raise ValueError("weight_scale holds NaN or inf values")
        param.copy_(tensor)
        return (param_name,)

    def _rows(self, param, shard_id):
        """The parameter's data, or its shard's rows of it."""
        if shard_id is None:
            return param.data
        offset, size = self.shard_offsets[shard_id]
        return param.data.narrow(0, offset, size)

    @torch.no_grad()
    def quantize_(self):
        """Turn a float layer into W8A8 in place (round-to-nearest per channel, no smoothing)."""
        if self.quantized:
            return
        q, scale = quantize_per_channel(self.weight.data)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.quantized = True
