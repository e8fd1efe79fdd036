"""The read ceiling: how fast a kernel that does nothing but read N bytes from HBM gets through them, timed the way a
benchmark times its own kernels. A weight-bound GEMM or a decode-attention call that must read N bytes cannot beat
it by much; at small N it sits well below the 1 GiB copy bandwidth, because a call's start (launch, the first bytes'
latency) and end (the last programs) are a fixed cost that a short stream cannot hide. On an H200 (2026-11-28,
docs/benchmarks/gemm.md, thirty-fifth session) 25 MB (Llama-3-8B's int8 qkv weights) read at ~82 % of the copy
bandwidth, 59 MB at ~94 %, 117 MB at ~101 % (a read can pass a copy, which also writes).

The kernel: each program XORs its contiguous share of the buffer (a multiple of 16 words; the last < 16 x programs
words stay unread), as int32 words loaded 16 bytes a thread, into one word it stores (so nothing is optimized away,
and tests can check that every byte was read). The ceiling is the best of a few launch geometries (programs x warps
x words per step).
"""

import torch
import triton
import triton.language as tl

# (programs, warps, int32 words per program step): the geometries that came out best across the sizes measured
GEOMETRIES = ((384, 8, 4096), (512, 8, 4096), (768, 4, 2048), (1024, 4, 2048), (1536, 4, 4096), (256, 8, 4096))


@triton.jit
def _read_kernel(src_ptr, out_ptr, words_per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = src_ptr + pid.to(tl.int64) * words_per_program
    offs = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), BLOCK), BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(0, words_per_program, BLOCK):  # words_per_program % 16 == 0: the mask keeps the 16-byte loads
        acc ^= tl.load(base + i + offs, mask=i + offs < words_per_program, other=0, eviction_policy="evict_first")
    tl.store(out_ptr + pid, tl.xor_sum(acc, 0))


def words_read(words, programs):
    """How many of `words` int32 words `programs` programs read: an equal share each, a multiple of 16 words."""
    return (words // programs) // 16 * 16 * programs


def read_words(src, out, programs, warps, block):
    """XOR of each program's share of the int32 buffer src into out[program] (out: >= programs int32 words)."""
    if src.dtype != torch.int32 or not src.is_contiguous() or out.dtype != torch.int32 or out.numel() < programs:
        raise ValueError(f"read_words needs a contiguous int32 src and an int32 out of >= {programs} words")
    per_program = words_read(src.numel(), programs) // programs
    if per_program == 0:
        raise ValueError(f"{src.numel()} words are too few for {programs} programs of 16-word shares")
    _read_kernel[(programs,)](src, out, per_program, BLOCK=block, num_warps=warps)
    return out[:programs]


def read_ceiling(nbytes, time_fn, n_buffers, device="cuda"):
    """The best read of nbytes over GEOMETRIES: dict(us, gbs, bytes, programs, warps, step_bytes). time_fn(fns) ->
    microseconds per call of the callables fns, called in turn (the caller's timer, e.g. bench_gemm.time_graph);
    n_buffers rotated buffers, so that together they exceed L2 as the caller's own operands do."""
    words = nbytes // 4
    bufs = [torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device=device) for _ in range(n_buffers)]
    out = torch.empty(max(g[0] for g in GEOMETRIES), dtype=torch.int32, device=device)
    best = None
    for programs, warps, block in GEOMETRIES:
        used = words_read(words, programs)
        if used == 0:
            continue
        us = time_fn([lambda b=b, p=programs, w=warps, k=block: read_words(b, out, p, w, k) for b in bufs])
        gbs = used * 4 / us / 1e3
        if best is None or gbs > best["gbs"]:
            best = dict(us=us, gbs=gbs, bytes=used * 4, programs=programs, warps=warps, step_bytes=block * 4)
    del bufs
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    if best is None:
        raise ValueError(f"{nbytes} bytes are too few for any read geometry")
    return best
