"""eightbit: a compact int8 LLM inference engine (W8A8 GEMMs, int8 paged KV cache, Triton kernels).

    from eightbit import LLM, SamplingParams
    llm = LLM()   # the embedded SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].outputs[0].text)
"""


def _adopt_checkout_folders():
    """Imported from a source checkout (an editable install, or Python started in the checkout's root), the root's
    folders engine/, kernels/, eval/... are this package's parts, as pyproject's package-dir maps them: the package's
    path finds them there too, so `import eightbit` works in the root after a plain `pip install .`; and the root
    comes off sys.path, where `kernels/` would shadow the installed package of that name (transformers 5.25 imports
    `kernels` wherever it finds one, and fails on ours)."""
    import os
    import sys
    from pathlib import Path

    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file() and (checkout / "kernels" / "int8_gemm.py").is_file():
        __path__.append(str(checkout))
        sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != checkout]


_adopt_checkout_folders()

from eightbit.engine.config import EngineConfig
from eightbit.engine.llm import LLM
from eightbit.engine.llm_engine import LLMEngine
from eightbit.engine.outputs import CompletionOutput, RequestOutput
from eightbit.engine.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "quantize"]


def quantize(*args, **kwargs):
    """Convert an HF checkpoint to an int8 (W8A8) checkpoint; see `eightbit quantize --help`."""
    from eightbit.quant.cli import quantize as _quantize

    return _quantize(*args, **kwargs)
