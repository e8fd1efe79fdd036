"""The fused ops the model calls, each dispatched by device.

CUDA tensors go to the GPU wrapper of the op (its module in _TRITON_MODULE below), everything
else to the plain-torch version in kernels/reference.py. Both have the same signature, so
the model code never branches on the backend. The Triton modules are imported on
first CUDA use, so a CPU-only install never imports triton. On sm_90 three wrappers hand
some shapes on to a Gluon kernel: int8_gemm to int8_gemm_hopper.py (large M) and
int8_gemm_swap.py (small M), prefill_attention to prefill_attention_hopper.py and
decode_attention to decode_attention_hopper.py; each wrapper module's docstring says when.
"""

import functools
import importlib
import inspect
import re

from eightbit.kernels import reference

# The GPU kernels are written against Triton 3.6: Gluon (the Hopper kernels) and its programmatic-dependent-launch
# calls (kernels/pdl.py), which older Tritons lack or spell differently.
MIN_TRITON = (3, 6)

_TRITON_MODULE = {
    "rms_norm": "rmsnorm_quant",
    "rmsnorm_quant": "rmsnorm_quant",
    "silu_mul": "silu_mul_quant",
    "silu_mul_quant": "silu_mul_quant",
    "quant_per_token": "quant_per_token",
    "int8_gemm": "int8_gemm",
    "rope_kv_write": "kv_write",
    "kv_write": "kv_write",
    "prefill_attention": "prefill_attention",
    "decode_attention": "decode_attention",
}


def _dispatch(name):
    reference_fn = getattr(reference, name)
    first_name = next(iter(inspect.signature(reference_fn).parameters))
    triton_fn = None

    @functools.wraps(reference_fn)  # help() and inspect.signature show the op's own parameters
    def op(*args, **kwargs):
        nonlocal triton_fn
        first = args[0] if args else kwargs.get(first_name)
        if not getattr(first, "is_cuda", False):
            return reference_fn(*args, **kwargs)
        if triton_fn is None:
            require_gpu_triton()
            module = importlib.import_module(f"eightbit.kernels.{_TRITON_MODULE[name]}")
            triton_fn = getattr(module, name)
        return triton_fn(*args, **kwargs)

    return op


def require_gpu_triton():
    """Raise a RuntimeError that says what to install when this environment's Triton cannot build the GPU kernels
    (missing, or older than MIN_TRITON), instead of an ImportError from inside a kernel module at the first CUDA
    call. The CPU path never needs Triton."""
    import torch

    try:
        import triton
    except ImportError:
        found = "no Triton"
    else:
        version = getattr(triton, "__version__", "of unknown version")
        match = re.match(r"(\d+)\.(\d+)", version)
        if match and tuple(map(int, match.groups())) >= MIN_TRITON:
            return
        found = f"Triton {version}"
    need = ".".join(map(str, MIN_TRITON))
    raise RuntimeError(f"eightbit's GPU kernels need Triton >= {need} (Gluon, programmatic dependent launch); this "
                       f"environment has {found} with torch {torch.__version__}. Install a CUDA build of torch whose "
                       f"Triton is {need} or newer (tested: torch 2.11 with Triton 3.6), or run on the CPU "
                       f"(device=\"cpu\").")


rms_norm = _dispatch("rms_norm")
rmsnorm_quant = _dispatch("rmsnorm_quant")
silu_mul = _dispatch("silu_mul")
silu_mul_quant = _dispatch("silu_mul_quant")
quant_per_token = _dispatch("quant_per_token")
int8_gemm = _dispatch("int8_gemm")
rope_kv_write = _dispatch("rope_kv_write")
kv_write = _dispatch("kv_write")
prefill_attention = _dispatch("prefill_attention")
decode_attention = _dispatch("decode_attention")
