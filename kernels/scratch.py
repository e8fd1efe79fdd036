"""Per-device int32 scratch buffers that kernels leave zeroed: split-K counters and sums, decode merge counters.

A kernel that counts arrivals (the last program of a group to arrive finishes the group's work) needs counters that
start at zero. Zeroing them before every launch would cost a kernel; instead the last arrival resets its counter, so
the buffer is zeroed once, when it is allocated, and reused by every launch after.
"""

import torch

_RETIRED = []  # buffers replaced by larger ones: kept alive, since a captured CUDA graph may still use their address


def zeroed_scratch(cache, device, n, min_size, what):
    """A per-device int32 buffer of >= n zeros from cache (a dict), grown outside CUDA-graph capture only: a graph
    keeps the address it captured, so the buffer must exist (and be large enough) before capture."""
    key = (device.type, device.index)
    buf = cache.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{what} must be allocated before CUDA-graph capture; run one eager call of each shape first (warm-up)"
            )
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, min_size), dtype=torch.int32, device=device)
        cache[key] = buf
    return buf
