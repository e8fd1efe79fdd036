"""Shared pieces of the engine benchmarks: the request list, the roofline, results on disk.

Every benchmark process appends its records (one JSON object per line) to
`OUT/results.jsonl`; the tables, the per-benchmark JSON files, the PNG plots and the
goal checks are all rendered from those records, so systems run as separate
processes (each under its own time cap) still end up in one table.

Bandwidth units: GB = 1e9 bytes. The copy bandwidth counts bytes read + written
(the same convention as eval/bench_attention.py and docs/benchmarks/gemm.md).
"""

import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass

import torch

RESULTS_FILE = "results.jsonl"


# --- the request list --------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    prompt: tuple  # token ids
    output_len: int  # tokens to generate (ignore_eos: exactly this many)


def parse_range(text) -> tuple[int, int]:
    """'100:1024' -> (100, 1024); '512' -> (512, 512)."""
    if isinstance(text, (tuple, list)):
        lo, hi = text
    elif ":" in str(text):
        lo, hi = (int(x) for x in str(text).split(":"))
    else:
        lo = hi = int(text)
    if not 1 <= lo <= hi:
        raise ValueError(f"bad length range {text!r}: need 1 <= lo <= hi")
    return int(lo), int(hi)


def make_requests(num_requests, input_len=(100, 1024), output_len=(100, 1024), vocab_size=32000, seed=0):
    """`num_requests` requests, input and output lengths uniform in the inclusive ranges, random token ids.

    Deterministic for a seed (Python's Mersenne Twister, independent of torch and the device), and
    prefix-stable: the first k requests of a list of n are the list of k.
    """
    in_lo, in_hi = parse_range(input_len)
    out_lo, out_hi = parse_range(output_len)
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        n_in = rng.randint(in_lo, in_hi)
        n_out = rng.randint(out_lo, out_hi)
        prompt = tuple(rng.randrange(vocab_size) for _ in range(n_in))
        requests.append(BenchRequest(prompt, n_out))
    return requests


def random_prompts(batch, prompt_len, vocab_size, seed):
    """`batch` random prompts of exactly `prompt_len` tokens (latency runs: no two share a prefix)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(batch)]


# --- bytes per decode step (the roofline) ------------------------------------------------


def tensor_nbytes(t) -> int:
    """Bytes of a tensor, including the inner tensors of a tensor subclass (torchao) and a bnb SCB."""
    total = 0
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name, None)
            if isinstance(inner, torch.Tensor):
                total += tensor_nbytes(inner)
    else:
        total += t.numel() * t.element_size()
    scb = getattr(t, "SCB", None)  # bitsandbytes Int8Params: per-row float32 scales
    if isinstance(scb, torch.Tensor):
        total += scb.numel() * scb.element_size()
    return total


def weight_bytes(model) -> dict:
    """Bytes of parameters read by one decode step, by kind; works for eightbit and HF Llama models.

    - linear: every decoder linear's weight, scales and bias (int8 + float32 scales for W8A8);
    - lm_head: the output projection, read in full every step (the embedding matrix when tied);
    - norms: every RMSNorm weight;
    - embedding_row: one row of the input embedding, read once per token (not per step).
    `shared` = linear + lm_head + norms is read once per step, whatever the batch.
    """
    params = list(model.named_parameters())  # tied weights appear once, under the embedding's name
    tied = not any("lm_head" in name for name, _ in params)
    out = dict(linear=0, lm_head=0, norms=0, embedding_row=0)
    for name, p in params:
        nbytes = tensor_nbytes(p)
        if "embed_tokens" in name:
            out["embedding_row"] += nbytes // p.shape[0]
            if tied:
                out["lm_head"] += nbytes
        elif "lm_head" in name:
            out["lm_head"] += nbytes
        elif "norm" in name:
            out["norms"] += nbytes
        else:
            out["linear"] += nbytes
    out["shared"] = out["linear"] + out["lm_head"] + out["norms"]
    return out


def decode_step_bytes(weights: dict, kv_bytes_per_token: float, context_lens) -> float:
    """Bytes read by one decode step of len(context_lens) sequences, sequence i attending context_lens[i] tokens."""
    return weights["shared"] + len(context_lens) * weights["embedding_row"] + kv_bytes_per_token * sum(context_lens)


def hf_kv_bytes_per_token(config, dtype=torch.bfloat16) -> float:
    """K and V of one token in every layer of an HF Llama config, in `dtype`."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits / 8


# --- copy bandwidth (the ceiling) --------------------------------------------------------


_copy_kernel = None


def _triton_copy():
    global _copy_kernel
    if _copy_kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

        def run(src, dst, block=8192):
            n = src.numel()
            copy_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=8)

        _copy_kernel = run
    return _copy_kernel


def _time_best(fn, device, iters):
    """Best wall seconds of fn over iters calls (after one warm-up), CUDA-event timed on the GPU."""
    fn()
    best = float("inf")
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def measure_copy_bandwidth(device="cuda", nbytes=1 << 30, iters=10) -> dict:
    """Device copy bandwidth in GB/s (bytes read + written), best of `dst.copy_(src)`, a torch
    elementwise kernel and (on CUDA, when triton imports) a plain Triton copy kernel.

    On the GPU use >= 1 GiB so the copy streams from HBM, not L2. Frees its buffers afterwards.
    """
    device = torch.device(device)
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    moved = 2 * n * 4
    out = {"bytes": n * 4}
    out["copy_"] = moved / _time_best(lambda: dst.copy_(src), device, iters) / 1e9
    out["torch_elementwise"] = moved / _time_best(lambda: torch.mul(src, 1.0, out=dst), device, iters) / 1e9
    out["triton"] = None
    if device.type == "cuda":
        try:
            kernel = _triton_copy()
            out["triton"] = moved / _time_best(lambda: kernel(src, dst), device, iters) / 1e9
            if not torch.equal(dst, src):
                raise RuntimeError("triton copy kernel produced wrong output")
        except Exception as e:  # a broken triton still leaves the torch numbers
            out["triton_error"] = f"{type(e).__name__}: {e}"
            out["triton"] = None
    out["best_gbs"] = max(v for k, v in out.items() if k in ("copy_", "torch_elementwise", "triton") and v)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# --- environment, records ----------------------------------------------------------------


def kernel_times(events) -> dict:
    """{kernel name: [total µs, launches]} from torch.profiler events (`prof.events()`), counting
    device-side events only: the CPU ops that launched them report the same time again."""
    from torch.autograd import DeviceType

    kernels = {}
    for e in events:
        if e.device_type == DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0.0, 0])
            k[0] += e.time_range.elapsed_us()
            k[1] += 1
    return kernels


def environment(device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except Exception:
        pass
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(dev)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(dev).total_memory / 2**30, 1)
        try:
            import triton

            env["triton"] = triton.__version__
        except Exception:
            pass
    else:
        env["gpu"] = None
    return env


def append_records(out_dir, records):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, RESULTS_FILE), "a") as f:
        for r in records:
            f.write(json.dumps(r, default=_json_default) + "\n")


def _json_default(o):
    if isinstance(o, BenchRequest):
        return asdict(o)
    if isinstance(o, (torch.dtype, torch.device)):
        return str(o)
    return repr(o)


def load_records(paths) -> list[dict]:
    """All records from results.jsonl files (or dirs holding one), in order; bad lines are skipped."""
    records = []
    for path in paths:
        if os.path.isdir(path):
            path = os.path.join(path, RESULTS_FILE)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
    return records


def latest(records, key) -> list[dict]:
    """The last record for each key(record), in first-seen order (a rerun replaces an earlier result)."""
    found = {}
    for r in records:
        found[key(r)] = r
    return list(found.values())


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=_json_default)
    os.replace(tmp, path)


# --- tables ------------------------------------------------------------------------------


def fmt(value, digits=None) -> str:
    """A table cell: thousands separators for big numbers, 2 decimals below 10, 1 below 1000."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:
            return "nan"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if digits is None:
            digits = 2 if abs(value) < 10 else 1
        return f"{value:.{digits}f}"
    return str(value)


def format_table(headers, rows, title=None) -> str:
    """A plain-text table: a title line, headers, a rule, one line per row; numbers right-aligned."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h)) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) for i in range(len(headers))]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [title] if title else []
    out += [line([str(h) for h in headers]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


def short_error(e: BaseException, limit=160) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
