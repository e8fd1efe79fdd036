"""Tiny random Llama-family checkpoints for tests (ours and other packages'): no download, seconds to make.

    make_tiny_checkpoint(folder, **config_overrides)  -> folder with config.json, sharded
        safetensors, a small byte-level BPE tokenizer and generation_config.json
    tiny_text(n_lines)                                -> deterministic English-like text
    hf_model_of(dequantized_state(folder), folder)    -> HF's model of an int8 checkpoint, weights dequantized;
        per_token_input_quant(model) then rounds its Linear inputs as W8A8 does (the reference of the int8 path)
"""

import random
from pathlib import Path

import torch

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will more can its out up what "
    "about into than them only other new some could time these two may first then do any like my now over such "
    "our man me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men work long"
).split()


def tiny_text(n_lines: int = 200, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 20))]
        lines.append(" ".join(words).capitalize() + ".")
    return "\n".join(lines) + "\n"


def make_tiny_tokenizer(vocab_size: int = 256):
    """A byte-level BPE tokenizer trained on tiny_text, with <s> (BOS) and </s> (EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(tiny_text(400, seed=1).splitlines(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_config(model_type: str = "llama", **overrides):
    from transformers import AutoConfig

    base = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, rope_theta=10000.0,
    )
    if model_type == "mistral":
        base["sliding_window"] = None
    base.update(overrides)
    return AutoConfig.for_model(model_type, **base)


def make_tiny_checkpoint(
    folder, model_type: str = "llama", *, seed: int = 0, max_shard_size="200KB", dtype=torch.float32,
    outliers: bool = True, tokenizer=None, **overrides,
) -> Path:
    """Save a random model of the Llama family (with a tokenizer) to `folder`; returns the folder.

    outliers: scale a few hidden channels of the norms and a few up_proj rows up, so the
    Linear inputs have the outlier channels SmoothQuant exists for.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder = Path(folder)
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():  # HF's init (std 0.02) gives near-linear, dull activations
            if p.dim() == 2:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)
            elif name.endswith(".bias"):  # HF's are zeros, which would let any bias handling pass
                p.normal_(0, 0.1)
        if outliers:
            g = torch.Generator().manual_seed(seed)
            for layer in model.model.layers:
                h = config.hidden_size
                ch = torch.randperm(h, generator=g)[:3]
                layer.input_layernorm.weight[ch] *= 20
                layer.post_attention_layernorm.weight[ch] *= 15
                rows = torch.randperm(config.intermediate_size, generator=g)[:3]
                layer.mlp.up_proj.weight[rows] *= 30
                layer.self_attn.v_proj.weight[:2] *= 10
    model.to(dtype)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=False)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    (tokenizer or make_tiny_tokenizer(config.vocab_size)).save_pretrained(folder)
    return folder


def bos_chat_tokenizer(tokenizer, eos_token="</s>"):
    """`tokenizer` turned into the kind Llama 3 and Mistral have: it puts a BOS (the vocabulary's token 1) in front
    of any text, and its chat template writes bos_token itself, so a chat prompt tokenized as plain text gets two."""
    import copy

    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    bos = tokenizer.convert_ids_to_tokens(1)
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos_token)
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tok


# --- W8A8 simulated in float, with HF transformers' own model: the reference for quantized checkpoints -------


def all_tensors(folder) -> dict:
    """Every tensor of a checkpoint folder's safetensors files."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def dequantized_state(folder) -> dict:
    """A quantized checkpoint's state dict with every int8 weight dequantized (float32), its scales dropped."""
    from eightbit.quant.int8 import dequantize

    tensors = all_tensors(folder)
    return {name: dequantize(x, tensors[name + "_scale"]) if x.dtype == torch.int8 else x.float()
            for name, x in tensors.items() if not name.endswith(".weight_scale")}


def hf_model_of(state: dict, config_dir):
    """HF transformers' float32 model of config_dir's config (its quantization_config dropped) holding `state`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)
    return model


def per_token_input_quant(model):
    """Make every decoder Linear see per-token int8-rounded inputs (W8A8 simulated in float)."""
    from eightbit.quant.int8 import dequantize, quantize_per_token

    def hook(module, args):
        q, s = quantize_per_token(args[0])
        return (dequantize(q, s),)

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and "layers." in name:
            m.register_forward_pre_hook(hook)
    return model
