"""An `eightbit quantize` checkpoint runs in the engine: W8A8 linears from the file, the KV scheme it names."""

import json

import pytest
import torch

from eightbit import LLM, SamplingParams, quantize
from eightbit.quant.testing import make_tiny_checkpoint, make_tiny_tokenizer, tiny_text


def prompt_logprobs(llm, ids):
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([entry[t] for entry, t in zip(out.prompt_logprobs[1:], ids[1:])])


def test_quantized_checkpoint_loads_and_stays_close_to_float(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "src", "llama", tokenizer=make_tiny_tokenizer(320))
    calib = tmp_path / "calib.txt"
    calib.write_text(tiny_text(200, seed=3))
    quantize(str(src), str(tmp_path / "int8"), calib_data=str(calib), num_samples=8, seq_len=64,
             kv_group_size=16, progress=False)
    options = dict(dtype="float32", device="cpu", kv_cache_memory_gb=0.05)
    ref = LLM(str(src), **options)
    int8 = LLM(str(tmp_path / "int8"), kv_cache_dtype="int8", **options)
    assert int8.engine.quantized and int8.engine.kv_group_size == 16  # the group size written in the checkpoint
    linear = int8.engine.model.model.layers[0].self_attn.qkv_proj
    assert linear.weight.dtype == torch.int8 and linear.weight_scale.dtype == torch.float32
    ids = [1] + [(13 * i + 7) % 300 + 3 for i in range(120)]
    a, b = prompt_logprobs(ref, ids), prompt_logprobs(int8, ids)
    assert not torch.equal(a, b)
    # mean |difference| 0.085 nats (W8A8 + int8 KV); per-tensor activation scales instead of per-token give 0.145
    assert (a - b).abs().mean() < 0.12
    # dummy weights of the folder's shape are its format too (they were float, with the default KV groups: a
    # benchmark pointed at an int8 checkpoint measured a float model)
    dummy = LLM(str(tmp_path / "int8"), load_format="dummy", kv_cache_dtype="int8", **options)
    assert dummy.engine.quantized and dummy.engine.kv_group_size == 16
    assert dummy.engine.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
    # another format's config (AWQ) still gives dummy weights of its shape, in float
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (tmp_path / "awq").mkdir()
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    awq = LLM(str(tmp_path / "awq"), load_format="dummy", **options)
    assert not awq.engine.quantized and awq.engine.model.model.layers[0].self_attn.qkv_proj.weight.is_floating_point()


W8A8_FAMILIES = {
    "llama": ("llama", {}),
    "llama3-rope-tied": ("llama", dict(tie_word_embeddings=True, max_position_embeddings=256, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "mistral": ("mistral", {}),
    "qwen2-qkv-bias": ("qwen2", {}),
}


@pytest.mark.parametrize("family", W8A8_FAMILIES)
def test_the_engines_w8a8_is_hf_with_int8_weights_and_per_token_int8_inputs(tmp_path, family):
    """Against float only loosely (W8A8 moves these random models' log-probs by ~0.1 nats): here against the same
    arithmetic in HF transformers' own model, int8 weights dequantized and every decoder Linear's input rounded per
    token to int8. Left are float32 sums of exact products and an input rounding flipped now and then: a wrong
    activation or weight scale on any one GEMM, or a shard's scale on another's rows, is many times more."""
    from eightbit.quant.testing import dequantized_state, hf_model_of, per_token_input_quant

    model_type, overrides = W8A8_FAMILIES[family]
    src = make_tiny_checkpoint(tmp_path / "src", model_type, tokenizer=make_tiny_tokenizer(320), **overrides)
    calib = tmp_path / "calib.txt"
    calib.write_text(tiny_text(100, seed=3))
    out = tmp_path / "int8"
    quantize(str(src), str(out), calib_data=str(calib), num_samples=4, seq_len=64, progress=False)
    llm = LLM(str(out), dtype="float32", device="cpu", kv_cache_memory_gb=0.05)  # float KV: W8A8 alone
    ids = [1] + [(13 * i + 7) % 300 + 3 for i in range(100)]
    ours = prompt_logprobs(llm, ids)
    reference = per_token_input_quant(hf_model_of(dequantized_state(out), out))
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([ids])).logits[0].double(), -1)
    theirs = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].float()
    float_gap = (prompt_logprobs(LLM(str(src), dtype="float32", device="cpu", kv_cache_memory_gb=0.05), ids)
                 - ours).abs().mean()
    gap = (ours - theirs).abs().mean()
    # measured: 2e-4 (llama, mistral), 3e-6 (qwen2), 4e-7 (llama3 tied) nats against 0.07-0.11 from float
    assert gap < 0.02 * float_gap, (gap, float_gap)


def test_w8a8_on_load_has_the_int8_weights_of_an_unsmoothed_checkpoint(tmp_path):
    """LLM(float checkpoint, quantization="w8a8") quantizes each weight from the checkpoint's own precision (float32
    here) as it loads, so at bfloat16 too its int8 weights and scales are the ones `eightbit quantize --alpha none`
    writes. It used to quantize the engine's bf16 copy: ~3 % of the int8 values one step off (review_s58_doors)."""
    src = make_tiny_checkpoint(tmp_path / "src", "llama", tokenizer=make_tiny_tokenizer(320))
    calib = tmp_path / "calib.txt"
    calib.write_text(tiny_text(50, seed=3))
    quantize(str(src), str(tmp_path / "int8"), calib_data=str(calib), num_samples=2, seq_len=32, alpha=None,
             progress=False)
    options = dict(dtype="bfloat16", device="cpu", kv_cache_memory_gb=0.05)
    on_load = LLM(str(src), quantization="w8a8", **options).engine.model
    written = LLM(str(tmp_path / "int8"), **options).engine.model
    for a, b in zip(on_load.linear_layers(), written.linear_layers(), strict=True):
        assert a.weight.dtype == torch.int8 and torch.equal(a.weight, b.weight)
        assert torch.equal(a.weight_scale, b.weight_scale)
