"""Random-weight models of real shapes, for benchmarks that need no checkpoint.

`LLM(model="llama-3-8b", load_format="dummy")` builds the named shape (or reads a config
dir's config.json) and fills every weight with N(0, 0.02) noise (the norms' with 1), then
quantizes the linears on the fly if `quantization="w8a8"` (or the dir is an int8 checkpoint's).
No Llama tokenizer is available offline, so dummy models take token-id prompts and produce no
text (only token ids).
"""

import os

import torch

KNOWN_SHAPES = {
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
    # a few-MB model of the same family, for CPU tests of the benchmark scripts
    "llama-tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048),
}


def check_model_shape(model):
    """Raise ValueError unless `model` names a known shape or a local directory with a config.json."""
    if model in KNOWN_SHAPES or (model is not None and os.path.isfile(os.path.join(model, "config.json"))):
        return
    raise ValueError(f"dummy weights need a model shape: one of {sorted(KNOWN_SHAPES)} or a local directory with "
                     f"a config.json, got {model!r}")


def dummy_config(model):
    from transformers import AutoConfig, LlamaConfig

    check_model_shape(model)
    if model in KNOWN_SHAPES:
        return LlamaConfig(**KNOWN_SHAPES[model])
    return AutoConfig.from_pretrained(model, local_files_only=True)


@torch.no_grad()
def load_dummy_model(config, check=None):
    from eightbit.engine.loader import LoadedModel, build_model, read_quantization
    from eightbit.quant.checkpoint_format import UnsupportedQuantizationConfig

    hf_config = dummy_config(config.model)
    # the config of an int8 checkpoint folder: int8 linears and its KV groups, as the checkpoint itself would load;
    # another format's (AWQ, GPTQ, FP8) gives only its shape, as before
    try:
        scheme = read_quantization(hf_config)
    except UnsupportedQuantizationConfig:
        scheme = None
    kv_group_size = scheme.kv_cache.group_size if scheme is not None else None
    if check is not None:
        check(hf_config, kv_group_size)
    model = build_model(hf_config, False, config.torch_dtype, config.device, config.max_model_len)
    generator = torch.Generator(device=config.device).manual_seed(config.seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)
    quantized = config.quantization == "w8a8" or scheme is not None
    if quantized:
        model.quantize_linears_()
    return LoadedModel(model, hf_config, None, [], kv_group_size, quantized)
