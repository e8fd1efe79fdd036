"""Each supported family against HF transformers' own model: tiny random checkpoints, logits compared."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from eightbit import LLM, SamplingParams
from eightbit.engine.layers.linear import Linear
from eightbit.engine.models.llama import LlamaForCausalLM
from eightbit.quant.testing import make_tiny_checkpoint, make_tiny_tokenizer, tiny_config

FAMILIES = {
    "llama": dict(model_type="llama"),
    "llama3-rope-scaling": dict(model_type="llama", max_position_embeddings=256, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "linear-rope-scaling": dict(model_type="llama", rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "yarn-rope-scaling": dict(model_type="llama", max_position_embeddings=256, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-tied-mha": dict(model_type="llama", tie_word_embeddings=True, num_key_value_heads=4),
    "mistral": dict(model_type="mistral"),
    "qwen2-qkv-bias": dict(model_type="qwen2"),
    # flags that only Llama reads: HF's Qwen2 and Mistral fix their biases (the engine expected o / MLP biases here)
    "qwen2-bias-flags": dict(model_type="qwen2", attention_bias=True, mlp_bias=True),
    "mistral-bias-flags": dict(model_type="mistral", attention_bias=True, mlp_bias=True),
}


@pytest.fixture(scope="module")
def tiny_tokenizer():

    return make_tiny_tokenizer(320)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_hf_logits(family, tmp_path, tiny_tokenizer):
    options = dict(FAMILIES[family])
    model_type = options.pop("model_type")
    folder = make_tiny_checkpoint(tmp_path / family, model_type, tokenizer=tiny_tokenizer, **options)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory_gb=0.05)
    ids = [1] + [(17 * i + 5) % 300 + 3 for i in range(150)]  # crosses several KV blocks, past the RoPE 64 boundary
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, logprobs=0,
                                              ignore_eos=True), use_tqdm=False)[0]
    generated = out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids + generated])).logits[0].double(), -1)
    ours = [entry[t] for entry, t in zip(out.prompt_logprobs[1:], ids[1:])]
    theirs = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(ours, dtype=torch.float64), theirs, atol=1e-4)
    for j, token in enumerate(generated):  # the decode path (cache reads) too
        assert abs(out.outputs[0].logprobs[j][token] - ref[len(ids) - 1 + j, token].item()) < 1e-4


def test_a_sliding_window_mistral_runs_up_to_its_window(tmp_path, tiny_tokenizer):
    """Refused outright before (Mistral-7B-v0.1's window is 4,096 of 32,768 positions); up to the window, sliding-window
    attention is full attention, so it runs there: HF's own model, which applies the window, agrees."""
    folder = make_tiny_checkpoint(tmp_path / "m", "mistral", tokenizer=tiny_tokenizer, sliding_window=64)
    with pytest.raises(ValueError, match="max_model_len=128 exceeds the model's sliding window of 64 tokens"):
        LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory_gb=0.05, max_model_len=128)
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory_gb=0.05)
    assert llm.engine.max_model_len == 64
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf.config.sliding_window == 64
    ids = [1] + [(13 * i + 7) % 300 + 3 for i in range(54)]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, logprobs=0,
                                              ignore_eos=True), use_tqdm=False)[0]
    generated = out.outputs[0].token_ids
    assert len(ids) + len(generated) == 63
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids + generated])).logits[0].double(), -1)
    ours = [entry[t] for entry, t in zip(out.prompt_logprobs[1:], ids[1:])]
    assert torch.allclose(torch.tensor(ours, dtype=torch.float64),
                          ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=1e-4)
    for j, token in enumerate(generated):
        assert abs(out.outputs[0].logprobs[j][token] - ref[len(ids) - 1 + j, token].item()) < 1e-4
    with pytest.raises(ValueError, match="leaves no room to generate within max_model_len=64"):
        llm.generate([[1] * 64], SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize("model_type, options, message", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0),
     "Qwen2 sliding-window attention is not implemented"),
    ("llama", dict(hidden_act="gelu"), "unsupported activation 'gelu'"),
])
def test_configs_the_model_would_run_wrongly_are_refused(model_type, options, message):
    """HF's own model applies the window / the activation: run as full attention / SiLU they would be silently wrong."""
    with pytest.raises(ValueError, match=message):
        LlamaForCausalLM(tiny_config(model_type, **options), dtype=torch.float32)


def test_llama_with_attention_and_mlp_biases_matches_hf(tmp_path):
    """Llama reads attention_bias and mlp_bias (Qwen2 and Mistral ignore them): q/k/v/o and gate/up/down get biases."""
    folder = make_tiny_checkpoint(tmp_path / "m", "llama", tokenizer=make_tiny_tokenizer(320), attention_bias=True,
                                  mlp_bias=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory_gb=0.05)
    ids = [1] + [(17 * i + 5) % 300 + 3 for i in range(40)]
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    ours = torch.tensor([e[t] for e, t in zip(out.prompt_logprobs[1:], ids[1:])], dtype=torch.float64)
    torch.testing.assert_close(ours, ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=1e-4, rtol=0)


def test_quantize_linears_gives_the_layout_of_a_model_built_w8a8():
    """load_format="dummy" with quantization="w8a8" (the benchmarks) quantizes a float model in place: it must run the
    same fused kernels as a model built W8A8 from an int8 checkpoint (norms and SiLU·up emitting int8)."""
    config = tiny_config(num_hidden_layers=2)
    converted = LlamaForCausalLM(config, quantized=False, dtype=torch.float32)
    converted.quantize_linears_()
    built = LlamaForCausalLM(config, quantized=True, dtype=torch.float32)

    def layout(model):
        return {name: (getattr(m, "quantize_output", None), getattr(m, "quantized", None))
                for name, m in model.named_modules() if hasattr(m, "quantize_output") or isinstance(m, Linear)}

    assert layout(converted) == layout(built)
