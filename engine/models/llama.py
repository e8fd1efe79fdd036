"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM) on fused layers.

Per decoder layer: RMSNorm (+ residual, + int8 quantization of its output for W8A8),
one q|k|v GEMM, RoPE + paged KV write + attention, the o GEMM, RMSNorm, one gate|up
GEMM, SiLU·up (+ quantization), the down GEMM. Inputs are the step's flattened new
tokens ([T]); shapes in comments use T for tokens, H for heads, D for head_dim.
"""

import torch
from torch import nn

from eightbit.engine.layers.attention import Attention
from eightbit.engine.layers.linear import Linear
from eightbit.engine.layers.norm import RMSNorm, SiluAndMul
from eightbit.engine.layers.rotary import check_rope_type
from eightbit.quant.schemes import head_dim, linear_has_bias

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# checkpoint module name -> (our fused module, shard id)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def check_supported(config):
    """Raise a clear error for a config this model can't run exactly."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {model_type!r}: eightbit runs {', '.join(SUPPORTED_MODEL_TYPES)} models"
        )
    if model_type == "qwen2" and getattr(config, "use_sliding_window", False):
        raise ValueError("Qwen2 sliding-window attention is not implemented")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported activation {config.hidden_act!r} (only silu)")
    check_rope_type(config)


def context_limit(config) -> int:
    """The longest sequence the model runs exactly: max_position_embeddings, or a Mistral sliding window shorter than
    that (sliding-window attention is not implemented; up to the window it is the same as full attention)."""
    limit = config.max_position_embeddings
    window = getattr(config, "sliding_window", None) if getattr(config, "model_type", None) == "mistral" else None
    return min(limit, window) if window else limit


class LlamaAttention(nn.Module):
    def __init__(self, config, quantized, dtype):
        super().__init__()
        d = head_dim(config)
        self.q_size = config.num_attention_heads * d
        self.kv_size = config.num_key_value_heads * d
        bias = linear_has_bias(config, "self_attn.q_proj")
        shards = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias, shards, quantized, dtype)
        o_bias = linear_has_bias(config, "self_attn.o_proj")  # Qwen2 has q/k/v biases but none on o
        self.o_proj = Linear(self.q_size, config.hidden_size, o_bias, None, quantized, dtype)
        self.attn = Attention(config.num_attention_heads, config.num_key_value_heads, d)

    def forward(self, positions, x):
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(positions, q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config, quantized, dtype):
        super().__init__()
        inter = config.intermediate_size
        bias = linear_has_bias(config, "mlp.gate_proj")
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias, {0: inter, 1: inter}, quantized, dtype)
        self.down_proj = Linear(inter, config.hidden_size, linear_has_bias(config, "mlp.down_proj"), None, quantized,
                                dtype)
        self.act = SiluAndMul(quantize_output=quantized)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, quantized, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, quantize_output=quantized)
        self.self_attn = LlamaAttention(config, quantized, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype,
                                                quantize_output=quantized)
        self.mlp = LlamaMLP(config, quantized, dtype)

    def forward(self, positions, hidden, residual):
        if residual is None:  # first layer: the embeddings start the residual stream
            residual = hidden
            x, _ = self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, quantized, dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, quantized, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids, positions):
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, quantized=False, dtype=torch.bfloat16):
        super().__init__()
        check_supported(config)
        self.config = config
        self.model = LlamaModel(config, quantized, dtype)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype=dtype)

    def forward(self, input_ids, positions):
        """input_ids, positions [T] -> final hidden states [T, hidden] (logits are a separate step)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden, out=None):
        """hidden [N, hidden] -> float32 logits [N, vocab] (written into `out` if given); lm_head stays in the float
        dtype (not quantized)."""
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        logits = torch.nn.functional.linear(hidden, weight)
        return logits.float() if out is None else out.copy_(logits)

    def quantize_linears_(self):
        """Turn every decoder linear into W8A8 (round-to-nearest, no smoothing) and quantize their inputs."""
        for linear in self.linear_layers():
            linear.quantize_()
        for layer in self.model.layers:
            for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.act):
                module.quantize_output = True

    def attention_layers(self):
        return [layer.self_attn.attn for layer in self.model.layers]

    def linear_layers(self):
        for layer in self.model.layers:
            yield from (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
