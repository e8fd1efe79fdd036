"""Relaunch a compiled Triton kernel without Triton's per-call argument binding.

`kernel[grid](...)` costs ~20-30 µs of Python per launch (binding and specializing every
argument, the cache key, the lookup) before the ~5 µs driver launch. An eager prefill step
of Llama-3-8B launches ~300 Triton kernels and was host-bound because of it (H200: GPU busy
~11 ms of a ~20 ms batch-1 step). `FastLauncher` keeps the CompiledKernel the first launch
returned and launches it directly next time (with a `bind` hook, the arguments it fills in, and
possibly the kernel of another constexpr value: FastLauncher.__init__), under a key that mirrors
what Triton specializes a kernel on:

    constexpr parameter         its value
    tensor                      dtype, and whether the address is 16-byte aligned
    TMA descriptor (Gluon)      dtype, block shape, shared-memory layout, padding
    int                         == 1, % 16 == 0 (just the 32-bit range for do_not_specialize)
    float                       nothing (always fp32)
    anything else (bool, None)  its value
    launch options              their values; and the current device

so a launch that Triton would compile differently misses the cache and takes the normal
path, which compiles (or finds) the right kernel. Under the CPU interpreter
(TRITON_INTERPRET=1), and on a Triton older than 3.4 (no `triton.knobs`), every launch takes the
normal path. Written against Triton 3.6's CompiledKernel.run (the version the GPU runs).
"""

import functools
import os

import torch
from torch import Tensor
from triton.runtime import driver
from triton.runtime.jit import JITFunction

try:  # the launch-hook settings moved to triton.knobs in 3.4; older Tritons take the normal path
    from triton import knobs
except ImportError:
    knobs = None

_I32 = (-(2**31), 2**31)


def interpreting():
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1): no compiled kernels, no inline PTX."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


def sm_count(device):
    """The multiprocessor count of a CUDA device (asked once per device); None for any other device."""
    if device.type != "cuda":
        return None
    return _properties(_index(device)).multi_processor_count


def is_sm90(device):
    """Whether a device is a Hopper GPU (sm_90: H100/H200; asked once per device), which the Gluon kernels need.
    (A ROCm build reports its GPUs as "cuda" devices too, and an MI200 as 9.0: not a Hopper.)"""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    props = _properties(_index(device))
    return (props.major, props.minor) == (9, 0)


def _index(device):
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _properties(index):
    return torch.cuda.get_device_properties(index)


def _int_key(v, specialize):
    if not _I32[0] <= v < _I32[1]:
        return ("wide int", v)  # another integer type: key on the value itself (rare)
    return ("int", v == 1, v & 15 == 0) if specialize else ("int",)


def arg_key(v, kind):
    """What Triton specializes argument v on; kind: "const" or (specialize ints, specialize alignment)."""
    if kind == "const":
        return v
    if isinstance(v, Tensor):
        return ("tensor", v.dtype, kind[1] and v.data_ptr() & 15 == 0)
    if type(v) is int:
        return _int_key(v, kind[0])
    if type(v) is float:
        return ("float",)
    if hasattr(v, "block_shape") and hasattr(v, "layout"):  # a host TMA descriptor (Gluon): its type, not its tensor
        return ("tensordesc", v.base.dtype, tuple(v.block_shape), v.layout, v.padding)
    return ("value", type(v), v)  # bool, None


class FastLauncher:
    def __init__(self, jit_fn, bind=None):
        """bind: optional, compiled kernel -> {parameter: value}, for arguments that only the compiled code can
        tell (decode_attention_hopper reads its barriers' shared-memory offsets from the PTX). Each new
        specialization is then compiled without a launch, bind() is asked once, and every launch of it gets
        those values in place of the caller's: do_not_specialize ints, or a constexpr that selects another kernel
        (which is then compiled and kept under the key of the one asked for)."""
        self.fn = jit_fn
        self.bind = bind
        self.compiled = {}
        # TRITON_INTERPRET=1 makes triton.jit return an InterpretedFunction: nothing compiled to keep
        self.enabled = knobs is not None and isinstance(jit_fn, JITFunction)
        if not self.enabled:
            return
        self.names = jit_fn.arg_names
        self.kinds = [  # per parameter: "const", or (specialize ints, specialize alignment)
            "const" if p.is_constexpr else (not p.do_not_specialize, not p.do_not_specialize_on_alignment)
            for p in jit_fn.params
        ]

    def key(self, values, options) -> tuple:
        return tuple(arg_key(v, kind) for v, kind in zip(values, self.kinds)), tuple(options.items())

    def __call__(self, grid, args: dict, **options):
        """fn[grid](**args, **options); args must name every kernel parameter, constexprs included."""
        if not self.enabled:
            self.fn[grid](**dict(args, **self._bound(grid, args, options)), **options)
            return
        values = [args[n] for n in self.names]
        device = driver.active.get_current_device()
        key = (device, self.key(values, options))
        entry = self.compiled.get(key)
        if entry is None:
            bound = self._bound(grid, args, options)
            kernel = self.fn[grid](**dict(args, **bound), **options)
            if hasattr(kernel, "packed_metadata"):
                self.compiled[key] = (kernel, [(self.names.index(n), v) for n, v in bound.items()])
            return
        kernel, fixed = entry
        for i, v in fixed:
            values[i] = v
        stream = driver.active.get_current_stream(device)
        g = tuple(grid) + (1,) * (3 - len(grid))
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(g, stream, *values),
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)

    def _bound(self, grid, args, options):
        """bind()'s values for the kernel these args compile to (compiled here, not launched); {} without bind."""
        if self.bind is None:
            return {}
        return self.bind(self.fn.warmup(grid=grid, **args, **options))
