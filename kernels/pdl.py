"""Programmatic dependent launch (PDL, sm_90): a kernel's programs start before the previous kernel ends.

Without it, a kernel's programs are scheduled only after every program of the previous kernel on the
stream has exited and its writes are flushed, and then they still have to start up. With PDL
(launched with `launch_pdl=True`) they are scheduled as soon as every program of the previous kernel
has executed `griddepcontrol.launch_dependents` (`allow_dependents`) or exited, and wait on the SM,
already set up, in `griddepcontrol.wait` (`wait_for_previous_kernel`): it returns once the previous kernel has
completed and its writes are visible. A kernel launched this way must wait before it writes anything and
before any read whose value matters, of anything an earlier kernel may have written.

Used here where a weight-bound linear layer starts: the Triton int8 GEMMs are launched with PDL at small
M (int8_gemm._pdl says which shapes) and wait before their first load, and the kernels that produce
their int8 inputs (rmsnorm_quant, silu_mul_quant, quant_per_token) allow dependents as they start.
Measured on an H100 (docs/benchmarks/gemm.md, twelfth session): engine decode 2.2 % faster per token at
batch 1 and 1.6 % more decode tokens/s at batch 64. Tried, not kept: the GEMMs allowing their own
dependents early (a GEMM right after a GEMM got up to 17 % slower at M = 8-16), and, before the chain below,
bulk-prefetching weight rows into L2 before the wait (faster for some shapes, slower for others).

And where the int8 decode attention starts: kv_write allows dependents as it starts, and the Gluon decode
kernel (decode_attention_hopper.py) is launched with PDL and waits before any read whose value matters. kv_write
+ decode per layer, H100: 0.6-1.0 us faster, bit-identical (docs/benchmarks/attention.md, fifteenth session; 0.6-2.1
us while the kernel still used its work order before waiting, but at a step's first layer the order's own kernel
runs just before, so it waits first; since the nineteenth session it reads the order before the wait only as a
hint for its L2 prefetch, below; since the forty-fourth, at the layers after a step's first, whose indices are
older than the kernel before it, for real: decode_attention_hopper.EARLY_INDICES).

The chain: a decode layer is rmsnorm_quant, qkv GEMM, kv_write, decode attention, quant_per_token, o GEMM,
rmsnorm_quant, gate_up GEMM, silu_mul_quant, down GEMM, all ours. So the other half of each hand-over is covered
too: the small-M GEMMs allow their dependents near the end of their K loop (the gemv kernel after its loop, the
dot kernel with one K step left, so that the next kernel's launch overlaps it: int8_gemm.TRIGGER_AHEAD_STEPS,
twentieth session) and the Gluon decode kernel once its producer has issued its last copy; the producers (the
norm, SiLU and quantization kernels, kv_write) are launched with PDL and wait as they start, right after allowing
their own dependents. A late trigger, not an early one: a GEMM that allowed dependents as it started let the
next GEMM's programs hold SM slots while it still streamed (the 17 % above). Measured on an H100
(docs/benchmarks/gemm.md and engine.md, eighteenth session): engine decode at batch 1 3.67 -> 3.58 ms per token
(two alternations in one call, both 3.58), the linear part of a decode layer 1-2 us faster at M <= 64,
bit-identical. Above M = 128, and for the Gluon GEMM, a GEMM gets PDL where its table entry is marked so
(gemm_configs.GemmConfig.pdl, measured by `tune_gemm --pdl`).
EIGHTBIT_PDL_CHAIN=0 (read at import), or setting CHAIN, goes back to the twelfth session's launches: the
producer-to-GEMM and kv_write-to-decode hand-overs only, table marks ignored.

What a kernel may do before its wait: no writes; reads of data that nothing writes while the chain runs (a GEMM's
weights, written when a model loads), or that was last written before an earlier kernel on the same stream that
allows its dependents only after its own wait (nothing after that kernel starts before its wait has returned, so
those writes are complete: the Gluon decode's settled indices); and reads of what the previous kernel may still be
writing only as hints, whose value may be stale without harm. An L2 prefetch (`prefetch_l2`) is such a hint, correct
whatever the line holds. So in the chain the PDL-launched Triton GEMMs pull the first lines of each of their
weight rows into L2 before waiting (int8_gemm.PREFETCH_LINES), and the Gluon decode kernel its first tile of
pages (decode_attention_hopper.PREFETCH_TILES), computing their addresses from indices (the work order, a
sequence's length, block-table entries) that it loads around L1 (`.cg`, so that no stale line stays there for
the loads after the wait) and clamps into their tensors. Their first loads after the wait then come from L2
instead of DRAM. Measured on an H100 (docs/benchmarks/gemm.md, attention.md and engine.md, nineteenth
session), same process: the linear part of a decode layer 1-7 % faster at M = 1-128, kv_write + decode +
quant_per_token 0.5-1.4 us faster a layer at batch 1-64; the engine's decode 2.5 % more tokens/s at batch 16,
3.7 % at 64, 0.5 % at batch 1; bit-identical.

The Gluon GEMM goes further: it copies its first weight tiles into shared memory before its wait
(int8_gemm_hopper.WEIGHTS_BEFORE_WAIT), real reads. Only the wait orders a read after earlier kernels' writes, and
the producers allow their dependents as they start, so such a GEMM can start while the kernel two places before
it still runs. A weight written by PyTorch ops needs nothing: a kernel launched without PDL lets the next one start
only once it has completed. A weight written by one of ours that allows dependents early (e.g. `quant_per_token`
used to quantize a weight matrix) must be followed by `torch.cuda.synchronize()`, or by any kernel launched
without PDL (a PyTorch op, in a CUDA graph too), before a GEMM multiplies by it (int8_gemm's docstring says so).

A program counts as having allowed its dependents at the first `launch_dependents` any of its threads executes
(Triton's and PTX's docs: repeated calls have no effect); the Gluon kernels execute it in their producer warp.

Since a kernel allows its dependents before it waits, the programs of three kernels can be on the GPU at once
(a GEMM finishing, the norm behind it waiting, the next GEMM's programs waiting on the norm). Every in-flight
kernel's programs are already resident when the next one may be scheduled (that is the trigger's condition),
so the waiting ones only take slots that are free; and each wait returns after the kernel just before has
completed, which itself waited for the one before it, so every earlier write is visible.

Both instructions do nothing in a kernel launched without the attribute, so one compiled kernel is
correct either way. The CPU interpreter has no inline PTX: the kernels take a PDL constexpr, False
there and off sm_90. EIGHTBIT_PDL=0 in the environment (read at import), or setting ENABLED, turns
PDL off for A/B runs.
"""

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from eightbit.kernels.launch import interpreting, is_sm90

ENABLED = os.environ.get("EIGHTBIT_PDL", "1") != "0"
# the chain (module docstring): GEMMs and decode attention allow dependents late, the producers wait for them
CHAIN = os.environ.get("EIGHTBIT_PDL_CHAIN", "1") != "0"


def pdl_enabled(device):
    """Whether kernels on this device use PDL: sm_90, compiled (not interpreted), and ENABLED. Asked at
    every launch of the GEMMs and their producers, so the device part is answered once per device."""
    return ENABLED and _supported(device)


def chain_enabled(device):
    """Whether the GEMMs allow their dependents near the end of their K loop and the producers wait for them."""
    return CHAIN and pdl_enabled(device)


def producer_launch(device):
    """(PDL constexpr, launch options) of a producer kernel (norm, SiLU, quantization, kv_write): it allows its
    dependents as it starts, and, in the chain, is itself launched with PDL and waits before its first read."""
    if not pdl_enabled(device):
        return False, {}
    return True, ({"launch_pdl": True} if CHAIN else {})


@functools.lru_cache(maxsize=None)
def _supported(device: torch.device):
    return is_sm90(device) and not interpreting()


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Block until the previous kernel on the stream has completed and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def allow_dependents(PDL: tl.constexpr):
    """Let the next kernel on the stream schedule its programs (they still wait for us before their reads)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """prefetch.global.L2 of each pointer's 128-byte line. A hint: correct whatever the line holds, so it may be
    issued before wait_for_previous_kernel."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
