"""The engine's one configuration object, validated on construction."""

from dataclasses import dataclass

import torch

from eightbit.engine.sampling_params import fields_as_python_numbers, is_bool, is_finite_number, is_int

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
KV_CACHE_DTYPES = ("auto", "int8")
QUANTIZATIONS = (None, "w8a8")
LOAD_FORMATS = ("auto", "dummy")


@dataclass
class EngineConfig:
    model: str | None = None  # HF checkpoint dir, GGUF file, int8 checkpoint dir, None = embedded SmolLM2
    dtype: str = "bfloat16"  # activations and the float weights
    device: str | None = None  # None: cuda if available, else cpu
    max_model_len: int | None = None  # None: the model's max_position_embeddings (a Mistral's sliding window)
    block_size: int = 16  # tokens per KV-cache block
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # the per-step token budget
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "auto" = the model dtype, or "int8"
    kv_group_size: int | None = None  # int8 KV: None = the checkpoint's, else 32
    quantization: str | None = None  # "w8a8": quantize a float checkpoint's linears on load (no smoothing)
    load_format: str = "auto"  # "dummy": random weights of the model's shapes
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float | None = None  # fixed KV-cache size; default on the CPU: 1 GiB
    num_kv_blocks: int | None = None  # fixed block count (tests); overrides the memory-based sizing
    enforce_eager: bool = False  # True: no CUDA graphs
    # launch the next decode step before this one's tokens reach the host. None: on CUDA only; on the CPU the
    # launch runs the whole forward before this step's tokens are handed back, so nothing overlaps and every
    # output comes a forward late (first output 0.22 against 0.15 s for SmolLM2)
    async_scheduling: bool | None = None
    seed: int = 0  # seeds the dummy weights and the sampling of requests that carry no seed of their own

    def __post_init__(self):
        if isinstance(self.dtype, torch.dtype):  # torch.bfloat16 as well as "bfloat16", as vLLM takes it
            self.dtype = str(self.dtype).removeprefix("torch.")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)} (or {list(DTYPE_ALIASES)}, or a torch dtype of "
                             f"those), got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.block_size & (self.block_size - 1):
            # the attention kernels read whole aligned runs of a page's keys (an int8 V page is key-minor)
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("max_model_len", "num_kv_blocks", "kv_group_size"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if not is_finite_number(self.gpu_memory_utilization) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_memory_gb is not None and (
                not is_finite_number(self.kv_cache_memory_gb) or self.kv_cache_memory_gb <= 0):
            raise ValueError(f"kv_cache_memory_gb must be a positive number or None, got {self.kv_cache_memory_gb!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "async_scheduling"):
            if not is_bool(getattr(self, name)) and not (name == "async_scheduling" and self.async_scheduling is None):  # a string such as "false" would read as on
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        fields_as_python_numbers(self)
        if self.kv_group_size is not None and self.kv_cache_dtype != "int8":
            raise ValueError("kv_group_size applies to the int8 KV cache only: pass kv_cache_dtype='int8' with it")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = str(checked_device(self.device))
        if self.async_scheduling is None:
            self.async_scheduling = self.device.startswith("cuda")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def checked_device(name) -> torch.device:
    """The device named, if this machine has it (checked here, before minutes of model loading)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {name!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but this machine has no CUDA GPU (torch sees none)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} asked for, but this machine has {torch.cuda.device_count()} GPU(s)")
    # the kernel launches, CUDA graphs, events and memory queries all use the current device (cuda:0 until CUDA is
    # initialized: asking earlier would initialize it, in a server's front process too)
    current = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    if device.index is not None and device.index != current:
        index = device.index
        raise ValueError(f"device {name!r} is not the current CUDA device (cuda:{current}): "
                         f"eightbit runs on the current one; select GPU {index} with CUDA_VISIBLE_DEVICES={index}, "
                         f"or torch.cuda.set_device({index}) before building the engine")
    return device
