"""The quantization schemes eightbit uses, as small validated dataclasses that serialize to dicts.

    weights            int8, symmetric, one scale per output channel, static (computed offline)
    input activations  int8, symmetric, one scale per token, dynamic (computed at run time)
    KV cache           int8, symmetric, per token and KV head in groups of G along head_dim,
                       float16 scales: one value costs 1 + 2/G bytes; |values| capped at 65024
                       (dequantized in float16, see int8.py)

The math itself lives in quant/int8.py; these objects only say which of it applies.
`weight_bytes` and `kv_bytes_per_token` give the memory a model config costs under a scheme.
"""

from dataclasses import asdict, dataclass, field

DEFAULT_KV_GROUP_SIZE = 32
KV_GROUP_SIZES = (8, 16, 32, 64)  # and head_dim itself (one group per head)


@dataclass(frozen=True)
class WeightScheme:
    num_bits: int = 8
    symmetric: bool = True
    strategy: str = "channel"  # one scale per output channel
    dynamic: bool = False

    def __post_init__(self):
        if (self.num_bits, self.symmetric, self.strategy, self.dynamic) != (8, True, "channel", False):
            raise ValueError(f"unsupported weight scheme {self}: eightbit has int8 symmetric per-channel static only")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ActivationScheme:
    num_bits: int = 8
    symmetric: bool = True
    strategy: str = "token"  # one scale per token (row)
    dynamic: bool = True

    def __post_init__(self):
        if (self.num_bits, self.symmetric, self.strategy, self.dynamic) != (8, True, "token", True):
            raise ValueError(
                f"unsupported activation scheme {self}: eightbit has int8 symmetric per-token dynamic only"
            )

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class KVCacheScheme:
    num_bits: int = 8
    group_size: int = DEFAULT_KV_GROUP_SIZE  # along head_dim, per token and KV head
    symmetric: bool = True
    scale_dtype: str = "float16"

    def __post_init__(self):
        if self.num_bits != 8 or not self.symmetric or self.scale_dtype != "float16":
            raise ValueError(f"unsupported KV-cache scheme {self}: eightbit has int8 symmetric, float16 scales only")
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 1:
            raise ValueError(f"KV-cache group size must be a positive integer, got {self.group_size!r}")

    def check_head_dim(self, head_dim: int) -> None:
        """Raise unless the group size is one of 8, 16, 32, 64 or head_dim and divides head_dim."""
        g = self.group_size
        if g != head_dim and (g not in KV_GROUP_SIZES or head_dim % g):
            raise ValueError(
                f"KV-cache group size {g} does not fit head_dim {head_dim}: use one of "
                f"{sorted({x for x in KV_GROUP_SIZES if head_dim % x == 0} | {head_dim})}"
            )

    def bytes_per_value(self) -> float:
        return 1 + 2 / self.group_size

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class QuantScheme:
    """W8A8 on every Linear except `ignore`, plus the int8 KV cache."""

    weights: WeightScheme = field(default_factory=WeightScheme)
    input_activations: ActivationScheme = field(default_factory=ActivationScheme)
    kv_cache: KVCacheScheme = field(default_factory=KVCacheScheme)
    ignore: tuple[str, ...] = ("lm_head",)

    def to_dict(self) -> dict:
        return {
            "weights": self.weights.to_dict(),
            "input_activations": self.input_activations.to_dict(),
            "kv_cache": self.kv_cache.to_dict(),
            "ignore": list(self.ignore),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "QuantScheme":
        return cls(
            weights=WeightScheme(**d.get("weights", {})),
            input_activations=ActivationScheme(**d.get("input_activations", {})),
            kv_cache=KVCacheScheme(**d.get("kv_cache", {})),
            ignore=tuple(d.get("ignore", ("lm_head",))),
        )


# --- memory cost of a model config under a scheme ----------------------------------------


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_token(config, kv: KVCacheScheme | None = None) -> float:
    """Bytes of KV cache one token costs across all layers: 2 (k, v) x layers x kv heads x head_dim x (1 + 2/G).

    kv=None means an unquantized bf16 cache (2 bytes a value)."""
    values = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config)
    return values * (2.0 if kv is None else kv.bytes_per_value())


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """[out, in] of each quantized Linear of one decoder layer (HF module names)."""
    h, i, d = config.hidden_size, config.intermediate_size, head_dim(config)
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }


def linear_has_bias(config, name: str) -> bool:
    """Whether the HF module `name` (as in linear_shapes) has a bias in this model family, as transformers builds
    it: Qwen2's q/k/v always and nothing else, Mistral's never; only Llama reads attention_bias and mlp_bias."""
    if config.model_type == "qwen2":
        return name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    if config.model_type == "mistral":
        return False
    if name.startswith("self_attn."):
        return bool(getattr(config, "attention_bias", False))
    return bool(getattr(config, "mlp_bias", False))


def weight_bytes(config, quantized: bool = True, float_bytes: int = 2) -> int:
    """Bytes of the model's weights as eightbit stores them.

    quantized: Linear weights int8 (1 byte) + one float32 scale per output channel; the
    embedding, norms, biases and lm_head stay in a `float_bytes`-byte float (bf16).
    quantized=False: everything in that float (the bf16 baseline).
    """
    h, layers = config.hidden_size, config.num_hidden_layers
    linear = sum(o * i for o, i in linear_shapes(config).values())
    scales = sum(o for o, _ in linear_shapes(config).values())
    shapes = linear_shapes(config)
    per_layer_float = 2 * h + sum(shapes[n][0] for n in shapes if linear_has_bias(config, n))  # norms, biases
    embed = config.vocab_size * h
    head = 0 if getattr(config, "tie_word_embeddings", False) else config.vocab_size * h
    float_params = embed + head + h + layers * per_layer_float
    if quantized:
        return layers * (linear + 4 * scales) + float_bytes * float_params
    return float_bytes * (layers * linear + float_params)
