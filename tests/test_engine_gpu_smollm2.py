"""The whole CUDA path on the real model (GPU only: `pytest -m gpu`).

The embedded SmolLM2-135M-Instruct through the Triton/Gluon kernels, CUDA graphs and PDL, against
independent references: HF transformers in float32 on the same weights (bf16 engine), and the
engine's CPU path, plain PyTorch (the int8 engine: W8A8 and the int8 KV cache).
"""

import copy
import math
from pathlib import Path

import pytest
import torch

from eightbit import LLM, SamplingParams
from eightbit.engine.weights import embedded_model_path

pytestmark = pytest.mark.gpu

PROMPTS = [
    "The capital of France is", "def quicksort(arr):", "Once upon a time, in a small village,",
    "The three laws of thermodynamics are", "List five prime numbers:", "Water boils at",
    "import numpy as np\n\n# compute the mean of", "Q: What is 12 times 12?\nA:",
]
NEW_TOKENS = 32
TOP = 5


@pytest.fixture(scope="module")
def gpu_llm():
    llm = LLM(dtype="bfloat16", device="cuda", max_model_len=2048, kv_cache_memory_gb=1.0)
    yield llm
    del llm
    torch.cuda.empty_cache()


def _hf_greedy(model, ids):
    """HF's greedy continuation of `ids` and its raw logits at each new position."""
    out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits).float()


@pytest.fixture(scope="module")
def hf_float32():
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    yield model.cuda().eval()
    del model
    torch.cuda.empty_cache()


def test_bf16_greedy_follows_hf_float32(gpu_llm, hf_float32):
    """vLLM's rule for bf16 against float32: where the two greedy continuations first differ, each
    side's token must be among the other's top 5 (and without a difference, they end together)."""
    tokenizer = gpu_llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=TOP)
    outs = gpu_llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ours = out.outputs[0]
        theirs, their_logits = _hf_greedy(hf_float32, tokenizer(prompt).input_ids)
        i = next((k for k, (a, b) in enumerate(zip(ours.token_ids, theirs)) if a != b), None)
        if i is None:
            assert len(ours.token_ids) == len(theirs), prompt
            continue
        their_top = their_logits[i].topk(TOP).indices.tolist()
        assert ours.token_ids[i] in their_top and theirs[i] in ours.logprobs[i], (
            f"{prompt!r}: diverged at token {i}, ours {ours.token_ids[i]}, HF {theirs[i]} (HF top {their_top})")


def _hf_prompt_logprobs(model, ids):
    logits = model(torch.tensor([ids], device="cuda")).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:], device="cuda")[:, None])[:, 0].cpu()


@torch.no_grad()
def test_bf16_prompt_logprobs_are_as_near_hf_float32_as_hf_bf16_is(gpu_llm, hf_float32):
    """Every position of a 1,024-token prompt (the prefill kernels and CUDA graphs): the log-prob of the actual next
    token against HF's in float32. FlashAttention's rule: our bf16 error at most twice HF's own bf16 error."""
    ids = gpu_llm.get_tokenizer()(_docs_text()).input_ids[:1024]
    out = gpu_llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ours = torch.tensor([entry[t] for entry, t in zip(out.prompt_logprobs[1:], ids[1:])])
    reference = _hf_prompt_logprobs(hf_float32, ids)
    hf_bf16 = _hf_prompt_logprobs(copy.deepcopy(hf_float32).to(torch.bfloat16), ids)
    ours_err, hf_err = (ours - reference).abs().mean(), (hf_bf16 - reference).abs().mean()
    print(f"prompt log-probs against HF float32, mean |diff|: ours bf16 {ours_err:.4f}, HF bf16 {hf_err:.4f} nats")
    assert ours_err <= 2 * hf_err + 0.005, (ours_err, hf_err)


@torch.no_grad()
def test_float32_engine_prompt_logprobs_match_hf_float32(hf_float32):
    """dtype="float32" on the GPU computes in float32 throughout, attention's dots included (Triton's default would
    run them as TF32): every prompt log-prob of a 1,024-token prompt within 1e-3 nats of HF's in float32. (H200:
    4.5e-5 at most; with TF32 attention dots 2.0e-2.)"""
    llm = LLM(dtype="float32", device="cuda", max_model_len=2048, kv_cache_memory_gb=1.0)
    try:
        ids = llm.get_tokenizer()(_docs_text()).input_ids[:1024]
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    finally:
        del llm
        torch.cuda.empty_cache()
    ours = torch.tensor([entry[t] for entry, t in zip(out.prompt_logprobs[1:], ids[1:])], dtype=torch.float64)
    err = (ours - _hf_prompt_logprobs(hf_float32, ids).double()).abs()
    print(f"float32 prompt log-probs against HF float32: max |diff| {err.max():.2e}, mean {err.mean():.2e} nats")
    assert err.max() <= 1e-3, err.max()


def _docs_text():
    return "\n\n".join(p.read_text() for p in sorted((Path(__file__).parents[1] / "docs").rglob("*.md")))


def _perplexity(llm, windows):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(windows, params, use_tqdm=False)
    nll = [-entry[tok] for w, o in zip(windows, outs) for tok, entry in zip(w[1:], o.prompt_logprobs[1:])]
    return math.exp(sum(nll) / len(nll))


def test_int8_perplexity_on_the_gpu_is_as_near_float32_as_the_cpu_path_in_bf16(gpu_llm):
    """W8A8 + int8 KV, 8 windows of 1,024 tokens (prefills through the int8-cache kernels, then one decode step each):
    the GPU kernels in bf16 against the same int8 math in float32 on the CPU (plain PyTorch). FlashAttention's
    rule: the GPU's difference at most twice the CPU path's own in bf16, plus 0.2 %."""
    ids = gpu_llm.get_tokenizer()(_docs_text()).input_ids
    windows = [ids[i : i + 1024] for i in range(0, 8 * 1024, 1024)]
    assert len(windows[-1]) == 1024
    options = dict(quantization="w8a8", kv_cache_dtype="int8", max_model_len=2048)
    gpu = _perplexity(LLM(device="cuda", dtype="bfloat16", kv_cache_memory_gb=1.0, **options), windows)
    cpu = _perplexity(LLM(device="cpu", dtype="bfloat16", kv_cache_memory_gb=0.5, **options), windows)
    reference = _perplexity(LLM(device="cpu", dtype="float32", kv_cache_memory_gb=0.5, **options), windows)
    print(f"int8 perplexity over {len(windows)} x 1,024 tokens: GPU bf16 {gpu:.4f}, CPU bf16 {cpu:.4f}, "
          f"CPU float32 {reference:.4f} ({100 * (gpu / reference - 1):+.3f} % / {100 * (cpu / reference - 1):+.3f} %)")
    assert 1 < reference < 1000
    assert abs(gpu / reference - 1) <= 2 * abs(cpu / reference - 1) + 2e-3
