"""Shared fixtures: the embedded SmolLM2 as an HF transformers model (the reference) and as our engine."""

import os

import torch

# Triton reads TRITON_INTERPRET once, when it is first imported (its own jit helpers such as tl.cdiv are built
# then), so it is set here, before any test module imports triton: without a GPU the kernels run on CPU tensors
# under the interpreter, with one they compile (the `gpu` tests). A value already set wins.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm_path():
    from eightbit.engine.weights import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def hf_model(smollm_path):
    """HF transformers' own Llama, float32, from the same GGUF: the independent reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(smollm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)


@pytest.fixture(scope="session")
def make_llm():
    """Build LLMs on the embedded model (float32, CPU); the parsed GGUF is cached across them."""
    from eightbit import LLM

    def make(**options):
        options.setdefault("dtype", "float32")
        options.setdefault("device", "cpu")
        options.setdefault("kv_cache_memory_gb", 0.25)
        options.setdefault("max_model_len", 2048)
        return LLM(**options)

    return make


@pytest.fixture(scope="session")
def llm(make_llm):
    return make_llm()
