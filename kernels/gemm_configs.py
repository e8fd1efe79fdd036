"""Launch configurations for int8_gemm: a committed table, looked up by (M bucket, N, K).

There is no autotuning at run time (it must never run inside CUDA-graph capture
or on a cold start). `eval/tune_gemm.py` times candidate configurations on the
GPU and writes `gemm_configs.json` beside this file; `get_config` reads it once
(lazily, at the first call) and falls back to `default_config` for shapes the
table does not hold.

The table is tuned on one card (its "device" field). `gemm_configs_by_device.json` holds, per device name
(`torch.cuda.get_device_name()`), the entries where another card measured a different config faster in the
engine (`tune_gemm --device-overrides` writes them); on that card they take precedence. EIGHTBIT_GEMM_BY_DEVICE=0
(read at import) or USE_DEVICE_ENTRIES = False ignores them. EIGHTBIT_GEMM_TABLE=PATH (read at the first lookup)
reads another table in place of the committed one, for an engine A/B of a candidate table
(eval/ab_gemm_table.py); a card's own entries still apply on top of it.

M is bucketed: a config tuned at bucket B serves every M in (previous bucket, B].
A config names its kernel: "dot" (the tiled tensor-core kernel, any M), "gemv" (the dp4a
weight-streaming kernel for M <= 8: block_m is then the activation rows per program, 1-8) or "ws"
(the warp-specialized Gluon kernel for large M on sm_90, int8_gemm_hopper.py: block_m 128 = two
64-row consumer warp groups, num_warps 4 = one warp group, split_k 1, block_n a power of two or the sum
of two, e.g. 192; falls back to "dot" elsewhere) or "swap" (the Gluon kernel for small M on sm_90,
int8_gemm_swap.py: block_m = the activation rows of its tile, 8-64, at least M; block_n 64 or 128 weight rows,
block_k <= 256, num_warps 4; falls back to "dot" elsewhere).
"""

import json
import os
from dataclasses import asdict, dataclass, field

import torch
import triton

# 384 ... 6144 between the powers of two: an M tuned for the next bucket up can fill its last wave badly (1B o at
# M = 384 on bucket 512's 128 x 128 tiles: 48 tiles for 132 SMs, 0.89x bf16 with the quantization; gemm.md,
# twenty-sixth session). From 256 to 1536 a bucket every 128 rows, the row blocks of the "ws" kernel's tiles, so
# that a bucket's M has as many row blocks as every M it serves (to 1024 since the twenty-seventh session; 1152-1408
# since the thirty-first: 8B qkv and gate_up at M = 1152-1408 take 6-8 % less time than on
# bucket 1536's entry)
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 640, 768, 896, 1024, 1152, 1280, 1408, 1536, 2048, 3072,
             4096, 6144, 8192)
TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemm_configs.json")  # the committed table
TABLE_ENV = "EIGHTBIT_GEMM_TABLE"
BY_DEVICE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemm_configs_by_device.json")
USE_DEVICE_ENTRIES = os.environ.get("EIGHTBIT_GEMM_BY_DEVICE", "1") != "0"


KERNELS = ("dot", "gemv", "ws", "swap")  # GemmConfig.kernel (the module docstring says which is which)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    kernel: str = "dot"
    # launched with programmatic dependent launch (kernels/pdl.py)? None: the rule, M <= int8_gemm.PDL_MAX_M for
    # the Triton kernels and never for "ws"; a table entry says True or False where `tune_gemm --pdl` measured
    # it. How a config is launched, not which kernel it is: left out of equality and key().
    pdl: bool | None = field(default=None, compare=False)

    def key(self):
        return (self.block_m, self.block_n, self.block_k, self.group_m, self.split_k, self.num_warps, self.num_stages,
                self.kernel)

    def to_dict(self):
        d = asdict(self)
        if d["pdl"] is None:
            del d["pdl"]
        return d


def m_bucket(m):
    """The smallest bucket >= m (the last bucket for anything larger)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def gemv_config(m, n, k, num_sms=132):
    """The gemv kernel for M <= 8: ~32 accumulator words per thread per row, split-K until ~2 programs per SM."""
    block_m = 1 if m <= 1 else (2 if m <= 2 else (4 if m <= 4 else 8))
    block_n = 16 if block_m <= 4 else 8
    block_k = {1: 1024, 2: 512, 4: 256, 8: 256}[block_m]
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    k_tiles = triton.cdiv(k, block_k)
    split_k = 1
    while tiles * split_k < 2 * num_sms and split_k * 2 <= 8 and k_tiles >= split_k * 2 * 2:
        split_k *= 2
    return GemmConfig(block_m, block_n, block_k, group_m=1, split_k=split_k, num_warps=4, num_stages=1, kernel="gemv")


def default_config(m, n, k, num_sms=132):
    """A sane configuration for any shape: gemv for M <= 4, narrow tiles + split-K up to M = 64, big tiles up
    to 256, the warp-specialized kernel from 512 (where it cannot run, int8_gemm takes dot_config instead)."""
    if m <= 4:
        return gemv_config(m, n, k, num_sms)
    if m > 256:
        return ws_config(m, n, num_sms)
    return dot_config(m, n, k, num_sms)


def ws_config(m, n, num_sms=132):
    """The warp-specialized kernel: 128 x 256 tiles when they fill every SM, else 128 x 128. On 10 shapes the
    table does not hold (Llama-2-7B, SmolLM2, 5120-wide) this ran 1.11-2.27x faster than dot_config at M
    512-8192 (geometric mean 1.40x; H100, docs/benchmarks/gemm.md)."""
    if (m // 128) * (n // 256) >= num_sms:
        return GemmConfig(128, 256, 64, group_m=8, split_k=1, num_warps=4, num_stages=6, kernel="ws")
    return GemmConfig(128, 128, 128, group_m=8, split_k=1, num_warps=4, num_stages=4, kernel="ws")


def dot_config(m, n, k, num_sms=132):
    """The default configuration of the tiled (tensor-core) kernel."""
    if m <= 64:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n = 64
        block_k = 256 if k >= 256 else max(32, triton.next_power_of_2(k))
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        k_tiles = triton.cdiv(k, block_k)
        split_k = 1
        while tiles * split_k < num_sms and split_k * 2 <= 8 and k_tiles >= split_k * 2 * 4:
            split_k *= 2
        return GemmConfig(block_m, block_n, block_k, group_m=1, split_k=split_k, num_warps=4, num_stages=4)
    if m <= 256:
        return GemmConfig(64, 128, 128, group_m=8, split_k=1, num_warps=4, num_stages=4)
    return GemmConfig(128, 256, 128, group_m=8, split_k=1, num_warps=8, num_stages=3)


_table = None
_by_device = None


def entry_key(entry):
    """A table entry's (m_bucket, n, k)."""
    return entry["m_bucket"], entry["n"], entry["k"]


def _entries(configs):
    return {entry_key(e): GemmConfig(**e["config"]) for e in configs}


def table_path():
    """The table get_config reads: $EIGHTBIT_GEMM_TABLE if set, else the committed one."""
    return os.environ.get(TABLE_ENV) or TABLE_PATH


def read_table(path):
    """{(m_bucket, n, k): GemmConfig} of the GEMM table file at path; ValueError naming it if it is not one."""
    try:
        with open(path) as f:
            return _entries(json.load(f)["configs"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a GEMM table ({{'configs': [table entries]}}): {type(e).__name__}: {e}") from e


def _load_table():
    global _table
    if _table is None:
        path = table_path()
        if path != TABLE_PATH and not os.path.isfile(path):
            raise FileNotFoundError(f"{TABLE_ENV}={path}: no such file (unset it to use the committed table)")
        _table = read_table(path) if os.path.exists(path) else {}
    return _table


def _load_by_device():
    """{device name: {(m_bucket, n, k): GemmConfig}} of gemm_configs_by_device.json."""
    global _by_device
    if _by_device is None:
        by_device = {}
        if os.path.exists(BY_DEVICE_PATH):
            try:
                with open(BY_DEVICE_PATH) as f:
                    by_device = {str(name): _entries(d["configs"]) for name, d in json.load(f).items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{BY_DEVICE_PATH} is not a map of device name -> {{'configs': [table entries]}}: "
                                 f"{type(e).__name__}: {e}") from e
        _by_device = by_device
    return _by_device


_merged = {}  # device name (None: the table alone) -> the table with its entries in place
_memo = {}  # (m, n, k, device name, USE_DEVICE_ENTRIES) -> get_config's answer: it runs at every GEMM launch
_MEMO_MAX = 1 << 14


def _table_for(device_name):
    """The table with the device's own entries in place."""
    key = device_name if USE_DEVICE_ENTRIES else None
    if key not in _merged:
        _merged[key] = {**_load_table(), **_load_by_device().get(key, {})} if key is not None else _load_table()
    return _merged[key]


def device_entries(device_name):
    """The entries that replace the table's on this device (none when USE_DEVICE_ENTRIES is off)."""
    if not USE_DEVICE_ENTRIES or device_name is None:
        return {}
    return dict(_load_by_device().get(device_name, {}))


def table_entries(device_name=None):
    """{(m_bucket, n, k): GemmConfig} of the committed table, with the device's own entries in place."""
    return dict(_table_for(device_name))


_names = {}  # CUDA device index -> name


def device_name_of_index(index):
    """device_name_of for a tensor's get_device() (-1: not CUDA, None): cheap enough for every GEMM launch."""
    if index < 0:
        return None
    name = _names.get(index)
    if name is None:
        name = _names[index] = torch.cuda.get_device_name(index)
    return name


def device_name_of(device):
    """The name the per-device entries are filed under: torch.cuda.get_device_name for a CUDA device (one without an
    index: the current one), else None."""
    if device.type != "cuda":
        return None
    return device_name_of_index(torch.cuda.current_device() if device.index is None else device.index)


def devices_with_entries():
    """The device names gemm_configs_by_device.json holds entries for."""
    return sorted(_load_by_device())


def get_config(m, n, k, device_name=None):
    """The committed config for this shape's bucket (the device's own entry first), else (M <= 16, dot default)
    the table's next larger bucket up to 16, else the default."""
    key = (m, n, k, device_name, USE_DEVICE_ENTRIES)
    cfg = _memo.get(key)
    if cfg is None:
        if len(_memo) >= _MEMO_MAX:
            _memo.clear()
        cfg = _memo[key] = _lookup(m, n, k, device_name)
    return cfg


def _lookup(m, n, k, device_name):
    table = _table_for(device_name)
    b = m_bucket(m)
    cfg = table.get((b, n, k))
    if cfg is not None:
        return cfg
    default = default_config(m, n, k)
    if default.kernel == "dot":
        for up in M_BUCKETS:
            if b < up <= 16 and (up, n, k) in table:
                return table[(up, n, k)]
    return default
