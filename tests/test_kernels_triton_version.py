"""The GPU path names the Triton it needs: at the first CUDA call an environment whose Triton is missing or older
than kernels.ops.MIN_TRITON gets a RuntimeError that says what to install, not an ImportError from inside a kernel
module (kernels/pdl.py imports Triton's programmatic-dependent-launch calls, the Hopper kernels import Gluon)."""

import sys

import pytest
import torch
import triton

from eightbit.kernels import ops


class _CudaLike:
    """Stands in for a CUDA tensor as the first argument of an op: the dispatch only asks is_cuda."""

    is_cuda = True


@pytest.mark.parametrize("version", ["3.5.1", "3.0.0", "2.3.1+gitdeadbeef"])
def test_an_older_triton_is_named_at_the_first_cuda_call(monkeypatch, version):
    monkeypatch.setattr(triton, "__version__", version)
    with pytest.raises(RuntimeError, match=r"need Triton >= 3\.6") as err:
        ops.int8_gemm(_CudaLike(), None, None, None)
    assert f"Triton {version}" in str(err.value) and torch.__version__ in str(err.value)
    assert 'device="cpu"' in str(err.value)


@pytest.mark.parametrize("version", ["3.6.0", "3.6.0+git1234abcd", "3.10.1", "4.0.0"])
def test_triton_3_6_and_newer_pass(monkeypatch, version):
    monkeypatch.setattr(triton, "__version__", version)
    ops.require_gpu_triton()  # no error


def test_no_triton_is_named_too(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    with pytest.raises(RuntimeError, match="this environment has no Triton"):
        ops.require_gpu_triton()


def test_the_cpu_path_never_asks(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "2.0.0")
    x = torch.randn(3, 8)
    q, scale = ops.quant_per_token(x)
    ref_q, ref_scale = ops.reference.quant_per_token(x)
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)


def test_a_triton_without_a_version_is_refused_by_name(monkeypatch):
    monkeypatch.delattr(triton, "__version__")
    with pytest.raises(RuntimeError, match="this environment has Triton of unknown version"):
        ops.require_gpu_triton()
