"""Shared fixtures: the embedded SmolLM2 as an HF transformers model (the reference) and as our engine."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# The repository root holds the source folders kernels/, eval/, engine/... that pyproject maps into `eightbit`;
# `python -m pytest` puts the working directory, the root, on sys.path, where they shadow installed packages of
# those names (transformers 5.25 imports the `kernels` package wherever it finds one, and fails on ours). The tests
# import `eightbit` only, so the root comes off the path before anything imports transformers.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]
os.environ["PYTHONSAFEPATH"] = "1"  # and the tests' `python -c` subprocesses do not put it there (Python >= 3.11)


def pytest_configure(config):
    """Triton reads TRITON_INTERPRET once, when it is first imported (its own jit helpers such as tl.cdiv are built
    then), so it is set here, before any test module imports triton. The kernels run on CPU tensors under the
    interpreter, unless this run selects the `gpu` tests on a machine with CUDA (`pytest -m gpu`): so the default
    run's kernel tests run on any machine. A value already set wins."""
    selects_gpu = "gpu" in (config.getoption("markexpr") or "").replace("not gpu", "")
    os.environ.setdefault("TRITON_INTERPRET", "0" if selects_gpu and torch.cuda.is_available() else "1")
    if os.environ["TRITON_INTERPRET"] == "0" and not torch.cuda.is_available():  # every kernel test would skip
        raise pytest.UsageError("TRITON_INTERPRET=0 on a machine without CUDA: the kernel tests need the Triton "
                                "interpreter here (unset it, or set it to 1)")
    # the tests hold the committed GEMM table: one named for an engine A/B (eval/ab_gemm_table.py) is not theirs
    os.environ.pop("EIGHTBIT_GEMM_TABLE", None)
    # converted GGUFs (engine/gguf_cache.py) go to this run's own directory, not the user's cache; subprocesses
    # inherit it, so the first process of the run converts the embedded model and the others read its copy
    if "EIGHTBIT_CACHE" not in os.environ:
        config.eightbit_cache = os.environ["EIGHTBIT_CACHE"] = tempfile.mkdtemp(prefix="eightbit-test-cache-")


def pytest_unconfigure(config):
    if getattr(config, "eightbit_cache", None):
        shutil.rmtree(config.eightbit_cache, ignore_errors=True)
        os.environ.pop("EIGHTBIT_CACHE", None)


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
        options.setdefault("async_scheduling", True)  # the engine's CUDA default, so its CPU tests cover that path
        return LLM(**options)

    return make


@pytest.fixture(scope="session")
def llm(make_llm):
    return make_llm()
