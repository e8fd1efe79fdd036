"""kernels/launch.py: the relaunch key must separate every pair of arguments that Triton itself
specializes differently (else a kernel compiled for one would run the other), checked against
Triton's own specializer on CPU tensors and Python scalars."""

import itertools
import os
import subprocess
import sys

import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from eightbit.kernels.launch import arg_key

_BASE = torch.zeros(256)


def _desc(rows, cols, block, dtype=torch.int8):
    t = torch.zeros(rows, cols, dtype=dtype)
    gdt = {torch.int8: gl.int8, torch.bfloat16: gl.bfloat16}[dtype]
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gdt))


# Gluon's host TMA descriptors: the kernel is specialized on dtype, block and layout, not on the tensor
DESCRIPTORS = [_desc(64, 128, [64, 64]), _desc(300, 512, [64, 64]), _desc(64, 128, [64, 128]),
               _desc(64, 128, [64, 32]), _desc(64, 128, [64, 64], torch.bfloat16)]
SAMPLES = [
    _BASE, _BASE[1:], _BASE[4:], _BASE[8:], _BASE.half(), _BASE.half()[8:], _BASE.to(torch.int8),
    _BASE.to(torch.int8)[3:], _BASE.to(torch.int8)[16:],
    0, 1, 2, 3, 15, 16, 17, 32, 48, 4096, 4097, -1, -16, 2**31 - 16, 2**31, 2**32 + 16, -(2**31) - 1,
    0.5, 1.0, 3.25, True, False, None,
] + DESCRIPTORS


def triton_spec(v, specialize, align):
    return native_specialize_impl(BaseBackend, v, False, specialize, align)


def test_equal_keys_only_for_equal_triton_specializations():
    for specialize, align in itertools.product((True, False), repeat=2):
        kind = (specialize, align)
        for a, b in itertools.combinations(SAMPLES, 2):
            if arg_key(a, kind) == arg_key(b, kind):
                assert triton_spec(a, specialize, align) == triton_spec(b, specialize, align), (a, b, kind)


def test_keys_are_not_needlessly_fine():
    """M of every prefill differs: ints that Triton treats alike must share one compiled kernel."""
    kind = (True, True)
    assert arg_key(17, kind) == arg_key(4097, kind) and arg_key(32, kind) == arg_key(4096, kind)
    assert arg_key(_BASE, kind) == arg_key(_BASE[4:], kind)
    assert arg_key(5, (False, True)) == arg_key(1, (False, True)) == arg_key(64, (False, True))
    assert arg_key(64, "const") != arg_key(128, "const")
    assert arg_key(DESCRIPTORS[0], kind) == arg_key(DESCRIPTORS[1], kind) != arg_key(DESCRIPTORS[2], kind)


def test_fast_launcher_reads_parameter_kinds(tmp_path):
    """In a compiled (not interpreted) Triton: constexprs, do_not_specialize and alignment flags."""
    code = (
        "import triton, triton.language as tl\n"
        "from eightbit.kernels.launch import FastLauncher\n"
        "@triton.jit(do_not_specialize=['M'], do_not_specialize_on_alignment=['y_ptr'])\n"
        "def k(x_ptr, y_ptr, M, N, s, FLAG: tl.constexpr, BLOCK: tl.constexpr):\n"
        "    pass\n"
        "f = FastLauncher(k)\n"
        "print(f.names, f.kinds)\n"
    )
    script = tmp_path / "kinds.py"  # triton.jit reads the kernel's source file
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.strip() == ("['x_ptr', 'y_ptr', 'M', 'N', 's', 'FLAG', 'BLOCK'] "
                           "[(True, True), (True, False), (False, True), (True, True), (True, True), 'const', 'const']")
