"""Build the model on the meta device, then stream the checkpoint's tensors into place one by one.

No second copy of the model is ever made: each tensor is read from the file (lazily,
by safetensors), copied into its slot of the fused parameter and dropped. (A GGUF that could
not be cached on disk is read from transformers' converted model in memory, dropped once
the engine's model is loaded.)
"""

import re
from dataclasses import dataclass

import torch

from eightbit.engine.layers.rotary import cos_sin_cache
from eightbit.engine.models.llama import PACKED_MODULES, LlamaForCausalLM, context_limit
from eightbit.engine.weights import open_checkpoint

_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    hf_config: object
    tokenizer: object
    eos_token_ids: list
    kv_group_size: int | None  # from an int8 checkpoint's KV scheme, else None
    quantized: bool


def load_model(config, check=None) -> LoadedModel:
    """The model of config.model (an HF folder, a GGUF, an int8 checkpoint; or dummy weights of its shape).
    check(hf_config, checkpoint's KV group size or None) runs before any weight loads (after a GGUF's conversion,
    which needs its config)."""
    if config.load_format == "dummy":
        from eightbit.engine.dummy import load_dummy_model

        return load_dummy_model(config, check)
    ckpt = open_checkpoint(config.model)
    hf_config = ckpt.config
    scheme = read_quantization(hf_config)
    kv_group_size = scheme.kv_cache.group_size if scheme is not None else None
    if check is not None:
        check(hf_config, kv_group_size)
    # a float checkpoint with quantization="w8a8": the linears are built int8 and quantize each weight as it loads
    # (round-to-nearest per channel, no smoothing), so the float weights never sit in memory all at once
    quantize_on_load = config.quantization == "w8a8" and scheme is None
    quantized = scheme is not None or quantize_on_load
    model = build_model(hf_config, quantized, config.torch_dtype, config.device, config.max_model_len)
    for linear in model.linear_layers() if quantize_on_load else ():
        linear.quantize_on_load = True
    tokenizer = ckpt.load_tokenizer()  # before the weights: a checkpoint without one fails in seconds, not minutes
    load_weights(model, ((name, ckpt.get_tensor(name)) for name in ckpt.tensor_names()))
    return LoadedModel(model, hf_config, tokenizer, ckpt.eos_token_ids, kv_group_size, quantized)


def read_quantization(hf_config):
    """The int8 scheme of a quantized checkpoint, None for a float one; unsupported formats raise."""
    if not getattr(hf_config, "quantization_config", None):
        return None
    from eightbit.quant.checkpoint_format import read_quantization_config

    return read_quantization_config(hf_config)


def build_model(hf_config, quantized, dtype, device, max_model_len=None) -> LlamaForCausalLM:
    """The model with empty weights on `device` (its config checked first); its RoPE table covers max_model_len
    positions (None: all the model runs, context_limit; a table for a million positions is 0.5 GB)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config, quantized=quantized, dtype=dtype)
    model.to_empty(device=device)
    max_positions = min(max_model_len or context_limit(hf_config), hf_config.max_position_embeddings)
    table = cos_sin_cache(hf_config, max_positions).to(device)
    for attn in model.attention_layers():
        attn.cos_sin_cache = table
    return model.eval()


def load_weights(model, named_tensors):
    """Copy (checkpoint name, tensor) pairs into the model; every parameter must be filled exactly once."""
    modules = dict(model.named_modules())
    expected = {name for name, _ in model.named_parameters()}
    loaded = {}  # parameter (or "parameter#shard") -> the checkpoint tensor that filled it
    for name, tensor in named_tensors:
        if _IGNORED.search(name) or (name == "lm_head.weight" and model.tie_word_embeddings):
            continue
        module_name, _, param_name = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        shard_id = None
        if leaf in PACKED_MODULES:
            fused, shard_id = PACKED_MODULES[leaf]
            module_name = f"{parent}.{fused}"
        module = modules.get(module_name)
        # a Linear names what it refuses itself; elsewhere only parameters are filled (not model.norm.eps, say)
        if module is None or not (hasattr(module, "load") or f"{module_name}.{param_name}" in expected):
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        suffix = "" if shard_id is None else f"#{shard_id}"
        slot = f"{module_name}.{param_name}{suffix}"
        if slot in loaded:
            raise ValueError(f"checkpoint tensor {name!r} appears twice (or also as {loaded[slot]!r})")
        try:
            if hasattr(module, "load"):
                filled = module.load(param_name, tensor, shard_id)
            else:
                _copy(getattr(module, param_name), tensor)
                filled = (param_name,)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        for param in filled:  # a weight quantized as it loads fills its scale too
            other = f"{module_name}.{param}{suffix}"
            if other in loaded:
                raise ValueError(f"checkpoint tensor {name!r} fills {other!r}, which {loaded[other]!r} filled")
            loaded[other] = name
    missing = [m for p in sorted(expected) for m in _missing(model, p, loaded)]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")


def _missing(model, param, loaded):
    """The checkpoint names of what `param` still lacks: itself, or the shards of a fused parameter."""
    if param in loaded:
        return []
    module_name, _, param_name = param.rpartition(".")
    module = model.get_submodule(module_name)
    if param_name == "weight_scale" and getattr(module, "quantize_on_load", False):
        return []  # it comes with its float weight, which is named where missing
    shards = getattr(module, "shard_offsets", None)
    if not shards:
        return [param]
    parent, _, fused = module_name.rpartition(".")
    leaf = {(f, s): name for name, (f, s) in PACKED_MODULES.items()}
    return [f"{parent}.{leaf[fused, s]}.{param_name}" for s in shards if f"{param}#{s}" not in loaded]


def _copy(param, tensor):
    if tensor.shape != param.shape:
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
    if param.is_floating_point() and not tensor.is_floating_point():  # an int8 embedding would be cast silently
        raise ValueError(f"must be a float tensor, the checkpoint has {tensor.dtype}")
    param.data.copy_(tensor)
