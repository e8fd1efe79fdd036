"""Relaunch a compiled Triton kernel without Triton's per-call argument binding.

`kernel[grid](...)` costs ~20-30 µs of Python per launch (binding and specializing every
argument, the cache key, the lookup) before the ~5 µs driver launch. A batch-1 prefill of
Llama-3-8B launches ~300 Triton kernels and is host-bound because of it (GPU busy 11 ms of a
~20 ms step on an H200). `FastLauncher` keeps the CompiledKernel the first launch returned,
under a key the call site builds from everything that decides Triton's specialization, and
launches it directly next time.

The key must determine the compiled kernel exactly: every constexpr and launch option, the
exact value of every int argument (Triton specializes ints on == 1 and % 16), the dtype of
every tensor argument and whether its address is 16-byte aligned (Triton specializes on
that), and the device (a CUDA tensor's `.device` always carries its index). Call sites
build it from their own shapes and configs.

Not used under the CPU interpreter (TRITON_INTERPRET=1), where every launch takes the normal path.
"""

import os

from triton import knobs
from triton.runtime import driver

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


def aligned(*tensors) -> tuple:
    """(dtype, address % 16 == 0) of each tensor: what Triton specializes a pointer argument on."""
    return tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors)


class FastLauncher:
    def __init__(self, jit_fn):
        self.fn = jit_fn
        self.names = jit_fn.arg_names
        self.compiled = {}

    def __call__(self, key, grid, args: dict, **options):
        """Launch fn[grid](**args, **options); args must name every kernel parameter, constexprs too."""
        kernel = None if _INTERPRET else self.compiled.get(key)
        if kernel is None:
            kernel = self.fn[grid](**args, **options)
            if not _INTERPRET and hasattr(kernel, "packed_metadata"):
                self.compiled[key] = kernel
            return
        values = [args[n] for n in self.names]
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        g = tuple(grid) + (1,) * (3 - len(grid))
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(g, stream, *values),
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)
