"""Shared fixtures: the embedded SmolLM2 as an HF transformers model (the reference) and as our engine."""

import pytest
import torch


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
