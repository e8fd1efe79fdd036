"""The read-ceiling kernel (eval/read_ceiling.py) under the interpreter: it reads every word of each program's share
and nothing past the whole steps; read_ceiling keeps the fastest geometry that covers the bytes."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from eightbit.eval import read_ceiling as RC


def _xor_rows(words, programs, per_program):
    return np.bitwise_xor.reduce(words[: programs * per_program].reshape(programs, per_program), axis=1)


@pytest.mark.parametrize("words,programs,block", [(4096, 4, 256), (5000, 3, 512), (1536, 2, 128), (1000, 3, 64)])
def test_each_program_xors_its_share(words, programs, block):
    g = torch.Generator().manual_seed(words)
    src = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, generator=g)
    out = torch.full((8,), -7, dtype=torch.int32)
    got = RC.read_words(src, out, programs, warps=1, block=block).numpy()
    per = RC.words_read(words, programs) // programs
    assert per % 16 == 0 and per * programs <= words < (per + 16) * programs  # shares of 16 words, < 16 left each
    np.testing.assert_array_equal(got, _xor_rows(src.numpy(), programs, per))
    assert (out[programs:] == -7).all()  # nothing written past the programs


def test_every_word_counts():
    src = torch.zeros(2048, dtype=torch.int32)
    src[1234] = 1 << 20
    out = torch.zeros(4, dtype=torch.int32)
    got = RC.read_words(src, out, 4, warps=1, block=256)
    assert got.tolist() == [0, 0, 1 << 20, 0]


def test_too_few_words_are_refused():
    with pytest.raises(ValueError, match="too few"):
        RC.read_words(torch.zeros(60, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), 4, 1, 256)


def test_read_ceiling_keeps_the_fastest_geometry_that_can_run(monkeypatch):
    # 4096 words: 4 and 2 programs read all of them; 512 programs would get 8 words each (< 16: skipped)
    monkeypatch.setattr(RC, "GEOMETRIES", ((4, 1, 256), (512, 1, 512), (2, 1, 1024)))
    timed = []

    def time_fn(fns):
        for f in fns:
            f()
        timed.append(len(fns))
        return {1: 4.0, 2: 2.0}[len(timed)]  # µs per call: the second geometry timed is faster

    best = RC.read_ceiling(4096 * 4, time_fn, n_buffers=2, device="cpu")
    assert timed == [2, 2]  # two geometries timed, two rotated buffers each
    assert (best["programs"], best["warps"], best["step_bytes"]) == (2, 1, 4096)
    assert best["bytes"] == 16384 and best["us"] == 2.0 and best["gbs"] == pytest.approx(16384 / 2.0 / 1e3)


def test_read_ceiling_without_a_geometry_that_can_run_says_so(monkeypatch):
    monkeypatch.setattr(RC, "GEOMETRIES", ((512, 1, 512),))
    with pytest.raises(ValueError, match="too few for any read geometry"):
        RC.read_ceiling(4096 * 4, lambda fns: 1.0, n_buffers=1, device="cpu")


def test_bench_gemm_prints_each_shapes_ceiling_beside_the_gemm_at_small_m():
    from eightbit.eval.bench_gemm import render_ceilings

    copy = 4000.0
    lin = [dict(model="m", op="qkv", m=1, wgbs_ours_gemm=3000.0), dict(model="m", op="qkv", m=16, wgbs_ours_gemm=2000.0),
           dict(model="m", op="qkv", m=1024, wgbs_ours_gemm=100.0)]
    ceil = [dict(model="m", op="qkv", n=6144, k=4096, us=7.5, gbs=3300.0, programs=384, warps=8, step_bytes=16384),
            dict(model="m", op="o", n=4096, k=4096, us=5.0, gbs=3200.0, programs=512, warps=4, step_bytes=8192)]
    lines = render_ceilings(copy, lin, ceil)
    header = next(line for line in lines if line.startswith("| model"))
    assert header.endswith("| gemm % copy bw, M = 1 | gemm % copy bw, M = 16 |")  # only M <= 16 columns
    assert "| m | qkv | 25.2 | 7.5 | 3300 | 82% | 384 × 8 warps × 16 KB | 75% | 50% |" in lines
    assert "| m | o | 16.8 | 5.0 | 3200 | 80% | 512 × 4 warps × 8 KB | — | — |" in lines
    assert render_ceilings(copy, lin, []) == []


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from eightbit.eval import read_ceiling as RC
fn = RC._read_kernel
for programs, warps, block in RC.GEOMETRIES:
    sig = {"src_ptr": "*i32", "out_ptr": "*i32", "words_per_program": "i32", "BLOCK": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}  # words_per_program % 16 == 0 (words_read)
    k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={"BLOCK": block}, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    loads = [line for line in k.asm["ptx"].splitlines() if "ld.global" in line]
    assert loads and all(".v4.b32" in line for line in loads), (block, warps, loads[:2])
    print(block, warps, len(loads))
"""


def test_read_kernel_compiles_for_sm90_with_16_byte_loads():
    """In a subprocess without TRITON_INTERPRET (as tests/test_kernels_compile_gemm.py): every geometry's build, and
    every global load a 16-byte vector (what the module says it measures)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("\n") == len(RC.GEOMETRIES)


def test_bench_attention_keeps_its_decode_row_when_the_ceiling_cannot_run(monkeypatch):
    from eightbit.eval import bench_attention

    def broken(*args, **kwargs):
        raise ValueError("too few")

    monkeypatch.setattr(RC, "read_ceiling", broken)
    assert bench_attention.read_ceiling_of(100) == {"read_ceiling_error": "ValueError('too few')"}


def test_read_words_refuses_what_it_cannot_read_or_hold():
    with pytest.raises(ValueError, match="contiguous int32 src"):
        RC.read_words(torch.zeros(4096, dtype=torch.int64), torch.zeros(4, dtype=torch.int32), 4, 1, 256)
    with pytest.raises(ValueError, match=">= 4 words"):
        RC.read_words(torch.zeros(4096, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 4, 1, 256)
