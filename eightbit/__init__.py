"""eightbit: a compact int8 LLM inference engine (W8A8 GEMMs, int8 paged KV cache, Triton kernels).

    from eightbit import LLM, SamplingParams
    llm = LLM()   # the embedded SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].outputs[0].text)
"""

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
