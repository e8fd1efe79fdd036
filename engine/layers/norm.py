"""RMSNorm with the residual add fused in, and optionally the per-token int8 quantization of its output."""

import torch
from torch import nn

from eightbit.engine.layers.linear import Int8Activation
from eightbit.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps, dtype=torch.bfloat16, quantize_output=False):
        super().__init__()
        self.eps = eps
        self.quantize_output = quantize_output  # True where every consumer of the output is a W8A8 linear
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x, residual=None):
        """Returns (normed output, new residual); with a residual, x + residual is normalized and returned."""
        if self.quantize_output:
            q, scale, residual = ops.rmsnorm_quant(x, self.weight, self.eps, residual)
            return Int8Activation(q, scale), residual
        return ops.rms_norm(x, self.weight, self.eps, residual)


class SiluAndMul(nn.Module):
    """SiLU(gate) * up on the fused gate|up output, optionally quantized for a W8A8 down projection."""

    def __init__(self, quantize_output=False):
        super().__init__()
        self.quantize_output = quantize_output

    def forward(self, gate_up):
        if self.quantize_output:
            return Int8Activation(*ops.silu_mul_quant(gate_up))
        return ops.silu_mul(gate_up)
