"""Block sizes for the attention kernels, chosen ahead of time (never autotuned at run time).

Keys are (head_dim, cache kind), where the cache kind is "int8" (group-quantized values +
float16 scales) or "float" (the model dtype). A head_dim missing from a table falls back to
the nearest entry below it (the kernels need a power-of-two head_dim anyway).

How the numbers were picked: eval/bench_attention.py sweeps a few candidates per shape on the
GPU (see docs/benchmarks/attention.md for the card and the date) and the best went here.

    prefill: BLOCK_M queries x BLOCK_N keys per step (BLOCK_N may span several cache pages);
             one table for short prompts, one for long ones (PREFILL_LONG)
    decode:  BLOCK_N keys per step, for one sequence and the whole group of query heads that
             share a KV head (padded to >= 16 rows for tl.dot)
"""

# (head_dim, cache kind) -> launch parameters
PREFILL = {
    (64, "float"): dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=5),
    (64, "int8"): dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3),
    (128, "float"): dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=4),
    (128, "int8"): dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
}

# Prefills averaging at least LONG_PREFILL_TOKENS query tokens per sequence (every key loop then runs
# thousands of keys) take these instead. From 5 stages on, Triton's pipeliner keeps the next tiles'
# paged K/V copies in flight during the dots; with fewer it waits for every copy at each step
# (the block-table read joins the same copy group). Bigger tiles pay off only on long loops: bf16
# d128 with 128 x 128 tiles on 8 warps ran 8-14 % faster from 3k tokens on and 10-20 % slower up
# to 1.5k, and 256 x 64 tiles another 2-5 % faster from 3k on (H100, docs/benchmarks/attention.md,
# seventh session).
LONG_PREFILL_TOKENS = 3072
PREFILL_LONG = {
    (64, "float"): dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=5),
    (64, "int8"): dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=5),
    (128, "float"): dict(BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=5),
    (128, "int8"): dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=5),
}

# The warp-specialized Gluon prefill (prefill_attention_hopper.py: a bfloat16/float16 cache on sm_90) takes every
# call it can run: head_dim -> keys per tile and ring slots. Same process, H100, 16k tokens per call (attention.md,
# thirteenth session). d = 128, one program per work item: 128 keys and 3 slots read 546 TFLOP/s at 4k, against
# 487 with 2 slots and no overlap inside the warp group, 424 with 2 slots and the overlap, 378 for the Triton
# kernel. d = 64, persistent grid: 128 keys and 4 slots beat the Triton kernel at every length, 117 against 111
# TFLOP/s at 256 tokens, 264 against 240 at 1k, 378 against 329 at 4k (3 slots: 89 at 256, 381 at 4k).
PREFILL_WS_ENABLED = True
PREFILL_WS = {
    64: dict(BLOCK_N=128, STAGES=4),
    128: dict(BLOCK_N=128, STAGES=3),
}

# An int8-cache prefill on sm_90 can dequantize the blocks its sequences use into a float copy once per call
# (kv_dequant.py) and run the Gluon kernel on it. Taken when the call averages at least MIN_TOKENS query tokens per
# sequence, or spans MIN_CONTEXT keys or more (block_tables' width: the engine passes the prefill sequences'
# columns), and the copy (K and V, in q's dtype) is at most MAX_BYTES: transient memory, which the engine keeps out
# of the KV-cache budget (33.5 MB per 8k-token sequence of Llama-3-8B). Never inside CUDA-graph capture.
# Same process, H100, against the int8 Triton kernel (attention.md, thirteenth session, persistent Gluon grid):
# full prefills 1.1x at 64 tokens, 1.3x at 128, 1.5x at 256, 1.8x at 512, 2.0-2.4x from 1k on; chunks of
# 16-1,024 queries after 8k or 32k keys 2.0-4.4x; but chunks of 16-256 queries after 2k keys 0.5-0.9x, so the
# token threshold stays at 256.
PREFILL_INT8_VIA_FLOAT = True
PREFILL_INT8_VIA_FLOAT_MIN_TOKENS = 256
PREFILL_INT8_VIA_FLOAT_MIN_CONTEXT = 8192
PREFILL_INT8_VIA_FLOAT_MAX_BYTES = 256 << 20

DECODE = {
    (64, "float"): dict(BLOCK_N=32, num_warps=1, num_stages=3),
    (64, "int8"): dict(BLOCK_N=64, num_warps=4, num_stages=2),
    (128, "float"): dict(BLOCK_N=32, num_warps=1, num_stages=3),
    (128, "int8"): dict(BLOCK_N=64, num_warps=4, num_stages=2),
}

# FlashDecoding split heuristic (decode): split only as far as the programs stay at or below this
# many per multiprocessor (rounding down: batch x kv heads at or above it runs one split per
# sequence), never giving a split fewer than MIN_TOKENS_PER_SPLIT keys of the longest possible
# context (block_tables.shape[1] * page size), and never more than MAX_SPLITS splits. Rounding up
# from 8 per SM (the earlier rule) split batch 64 three ways and cost 3-20 % at batch 8-128, int8 and
# bf16 alike (H100 A/B, docs/benchmarks/attention.md, sixth session).
DECODE_PROGRAMS_PER_SM = 4
DECODE_MIN_TOKENS_PER_SPLIT = 128
DECODE_MAX_SPLITS = 128
DEFAULT_SM_COUNT = 132  # H100/H200 SXM; used when no CUDA device can be asked

# The warp-specialized Gluon decode kernel (decode_attention_hopper.py, int8 cache on sm_90) takes calls with
# at least DECODE_WS_MIN_PROGRAMS (sequence, kv head) pairs (1: every call it can run) and splits them for
# DECODE_WS_PROGRAMS_PER_SM programs per SM: two of its programs are resident on an SM, so one round of equal
# work items is best. Same process, every split count of both kernels (H100, docs/benchmarks/attention.md,
# eleventh session): that rule picked the best count of the Gluon kernel from batch 1 x 8k to 64 x 2k and with
# the engine's mixed lengths, and with it the Gluon kernel was equal to the Triton kernel or ahead at every
# batch and context: 1 x 32k 61 vs 57 % of the copy bandwidth, 4 x 8k 61 vs 57 %, 32 x 2k 72 vs 62 %.
# One split at batch 16 (one program an SM, with 3-6 ring slots) instead of the rule's two read 7-35 % slower on an
# H200 (forty-sixth session): one program's math warps stream ~94 keys/us an SM, two ~113.
DECODE_WS_MIN_PROGRAMS = 1
DECODE_WS_PROGRAMS_PER_SM = 2
# The Gluon kernel's persistent grid starts the longest sequences' work items first (a greedy longest-first
# schedule; the hardware hands out programs in order as SMs free up). With the engine's mixed lengths it read
# 4-9 points more of the copy bandwidth at batch 16-256 (H100, attention.md, eleventh session).
DECODE_LONGEST_FIRST = True
# With 2 to DECODE_WS_MERGE_IN_KERNEL_MAX_SPLITS splits, the Gluon kernel merges them itself: the last split of a
# (sequence, kv head) to finish (a counter per pair, as int8_gemm's split-K) merges the group's partials with keys
# into the output, instead of the merge kernel running after it. Same process, H100 (attention.md, sixteenth
# session): 1.0-1.7 us faster a call at batch 2-16 (16 to 2 splits), e.g. 16 x 2k 70 -> 72 % of the copy bandwidth,
# 8 x 2k 57 -> 59-60 %. At batch 1 (33 splits) it was 0.1-0.4 us slower then, so 33 splits kept the merge kernel.
# Since the merge skips the empty splits, and the merge kernel (launched plainly) breaks the PDL chain, batch 1 is
# faster merged in the kernel too (nineteenth session): behind kv_write 0.9-1.2 us at 640-8k keys, equal at 32k;
# back to back 1.9-2.2 us, 1 x 32k 34.2 -> 32.1 us. So up to 64 splits merge in the kernel. More (only with one or
# two kv heads, up to DECODE_MAX_SPLITS) keep the merge kernel, whose programs merge each query head in parallel
# where one of ours merges the splits in steps of MERGE_CHUNK (not measured). 0: always the merge kernel.
DECODE_WS_MERGE_IN_KERNEL_MAX_SPLITS = 64

# The merge kernel after a split decode takes REDUCE_CHUNK splits per step at most, and a call the smallest chunk of
# REDUCE_CHUNKS that holds its split count, with that chunk's launch options (the count itself is a run-time
# argument). Few chunks: the first split call of a shape launches (compiles) them all, so no later split count
# compiles one mid-run. The merge alone, same process (H100, attention.md, fifteenth
# session): 2 splits at batch 16 in 1.6 us with a 4-split chunk on one warp, 1.9 with 2 on four warps, 4.3 with 128
# on four (the one chunk before: in the whole call it cost the int8 decode at 16 x 2k 4.5 of its 36 us); 33 splits
# at batch 1 in 2.2 us with 128 on four warps, 11.2 on one.
REDUCE_CHUNK = DECODE_MAX_SPLITS
# chunk -> launch options, in ascending order, the last one REDUCE_CHUNK
REDUCE_CHUNKS = {4: dict(num_warps=1), 16: dict(num_warps=1), REDUCE_CHUNK: dict(num_warps=4)}
KV_WRITE = dict(num_warps=4)


def cache_kind(cache_dtype) -> str:
    import torch

    return "int8" if cache_dtype == torch.int8 else "float"


def _lookup(table, head_dim, kind):
    if (head_dim, kind) in table:
        return dict(table[(head_dim, kind)])
    dims = sorted(d for d, k in table if k == kind)
    below = [d for d in dims if d <= head_dim]
    return dict(table[(below[-1] if below else dims[0], kind)])


def prefill_config(head_dim, cache_dtype, tokens_per_seq=0):
    """tokens_per_seq: the call's query tokens / sequences (known on the host, so graph-safe)."""
    table = PREFILL_LONG if tokens_per_seq >= LONG_PREFILL_TOKENS else PREFILL
    return _lookup(table, head_dim, cache_kind(cache_dtype))


def decode_config(head_dim, cache_dtype):
    return _lookup(DECODE, head_dim, cache_kind(cache_dtype))


def decode_num_splits(batch, num_kv_heads, max_context, sm_count=None, programs_per_sm=None):
    """Splits along the context for the FlashDecoding kernels, from shapes only (graph-safe).
    programs_per_sm: the target (default DECODE_PROGRAMS_PER_SM, the Triton kernel's)."""
    sm = sm_count or DEFAULT_SM_COUNT
    programs = max(1, batch * num_kv_heads)
    want = ((programs_per_sm or DECODE_PROGRAMS_PER_SM) * sm) // programs
    cap = max(1, max_context // DECODE_MIN_TOKENS_PER_SPLIT)
    return int(max(1, min(want, cap, DECODE_MAX_SPLITS)))
