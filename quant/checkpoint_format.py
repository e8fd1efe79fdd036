"""The `quantization_config` of an eightbit checkpoint, in the compressed-tensors form.

Written into config.json, it is what vLLM and llm-compressor read for an int8 W8A8 model:

    {"quant_method": "compressed-tensors", "format": "int-quantized",
     "quantization_status": "compressed",
     "config_groups": {"group_0": {"targets": ["Linear"],
         "weights":           {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel", "dynamic": false},
         "input_activations": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "token",   "dynamic": true}}},
     "ignore": ["lm_head"], "kv_cache_scheme": null,
     "eightbit": {"version": 1, "kv_cache": {...}, "calibration": {...}}}

Tensors: `<module>.weight` int8 [out, in] and `<module>.weight_scale` float32 [out, 1].
Our int8 KV cache (groups along head_dim, float16 scales) is not a compressed-tensors
kv_cache_scheme (those are per-tensor/per-head, and vLLM would act on them), so it lives
under "eightbit", which other readers ignore. So does the calibration summary.
"""

import copy

from eightbit.quant.errors import QuantizeError
from eightbit.quant.schemes import ActivationScheme, KVCacheScheme, QuantScheme, WeightScheme

QUANT_METHOD = "compressed-tensors"
FORMAT = "int-quantized"
EIGHTBIT_KEY = "eightbit"
EIGHTBIT_VERSION = 1


class UnsupportedQuantizationConfig(QuantizeError):
    """config.json's quantization_config describes a format eightbit cannot run."""


def _ct_args(num_bits, symmetric, strategy, dynamic) -> dict:
    return {
        "num_bits": num_bits,
        "type": "int",
        "symmetric": symmetric,
        "group_size": None,
        "strategy": strategy,
        "block_structure": None,
        "dynamic": dynamic,
        "actorder": None,
        "observer": None if dynamic else "minmax",
        "observer_kwargs": {},
    }


def build_quantization_config(scheme: QuantScheme, calibration: dict | None = None) -> dict:
    """The quantization_config dict for config.json (calibration: our summary of the run, JSON-able)."""
    w, a = scheme.weights, scheme.input_activations
    eightbit = {"version": EIGHTBIT_VERSION, "kv_cache": scheme.kv_cache.to_dict()}
    if calibration is not None:
        eightbit["calibration"] = copy.deepcopy(calibration)
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": _ct_args(w.num_bits, w.symmetric, w.strategy, w.dynamic),
                "input_activations": _ct_args(a.num_bits, a.symmetric, a.strategy, a.dynamic),
                "output_activations": None,
                "format": FORMAT,
            }
        },
        "ignore": list(scheme.ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        EIGHTBIT_KEY: eightbit,
    }


def _get(config, key, default=None):
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def _check_args(where: str, args, strategy: str, dynamic: bool) -> None:
    if not isinstance(args, dict):
        raise UnsupportedQuantizationConfig(f"{where} is missing or not an object (got {args!r})")
    want = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy}
    got = {k: args.get(k, "int" if k == "type" else None) for k in want}
    if args.get("symmetric") is None:
        got["symmetric"] = True  # compressed-tensors' default
    if got != want or bool(args.get("dynamic", False)) != dynamic or args.get("group_size") is not None:
        raise UnsupportedQuantizationConfig(
            f"{where} is {got | {'dynamic': args.get('dynamic', False)}}; eightbit runs only "
            f"{want | {'dynamic': dynamic}} (int8 W8A8: weights per channel static, activations per token dynamic)"
        )


def read_quantization_config(config) -> QuantScheme:
    """Our scheme objects from a model config (a transformers config, or config.json as a dict).

    Accepts what `build_quantization_config` writes and any plain compressed-tensors
    int8 W8A8 config (e.g. from llm-compressor), which then gets the default KV scheme.
    Anything else raises UnsupportedQuantizationConfig naming the problem.
    """
    qc = _get(config, "quantization_config")
    if qc is None:
        raise UnsupportedQuantizationConfig("the config has no quantization_config: not a quantized checkpoint")
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc)
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise UnsupportedQuantizationConfig(
            f"quantization_config has quant_method {method!r}; eightbit reads only {QUANT_METHOD!r} int8 W8A8"
        )
    fmt = qc.get("format")
    if fmt != FORMAT:
        raise UnsupportedQuantizationConfig(f"quantization_config has format {fmt!r}; eightbit reads only {FORMAT!r}")
    status = qc.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise UnsupportedQuantizationConfig(f"quantization_status {status!r}: the weights are not stored as int8")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise UnsupportedQuantizationConfig(
            f"quantization_config has {len(groups)} config groups; eightbit reads exactly one (all Linears W8A8)"
        )
    (name, group), = groups.items()
    if not isinstance(group, dict):
        raise UnsupportedQuantizationConfig(f"config group {name!r} is a preset reference ({group!r}), not a scheme")
    targets = group.get("targets") or []
    if list(targets) != ["Linear"]:
        raise UnsupportedQuantizationConfig(f"config group {name!r} targets {targets}; eightbit needs ['Linear']")
    if group.get("format", fmt) not in (None, FORMAT):
        raise UnsupportedQuantizationConfig(f"config group {name!r} has format {group.get('format')!r}")
    _check_args(f"config group {name!r} weights", group.get("weights"), "channel", False)
    _check_args(f"config group {name!r} input_activations", group.get("input_activations"), "token", True)
    if group.get("output_activations") is not None:
        raise UnsupportedQuantizationConfig("output activation quantization is not supported")
    if qc.get("kv_cache_scheme") is not None:
        raise UnsupportedQuantizationConfig(
            "a compressed-tensors kv_cache_scheme is not supported (eightbit's int8 KV cache is set under 'eightbit')"
        )
    if qc.get("sparsity_config") or qc.get("transform_config"):
        raise UnsupportedQuantizationConfig("sparsity or transform configs are not supported")
    ignore = tuple(qc.get("ignore") or ())
    if set(ignore) != {"lm_head"}:
        raise UnsupportedQuantizationConfig(
            f"ignore is {list(ignore)}; eightbit runs checkpoints whose every Linear but lm_head is int8"
        )
    ours = qc.get(EIGHTBIT_KEY) or {}
    if not isinstance(ours, dict):
        raise UnsupportedQuantizationConfig(f"quantization_config.{EIGHTBIT_KEY} must be an object, got {ours!r}")
    version = ours.get("version", EIGHTBIT_VERSION)
    if not isinstance(version, int) or isinstance(version, bool):
        raise UnsupportedQuantizationConfig(f"the checkpoint's eightbit version must be an integer, got {version!r}")
    if version > EIGHTBIT_VERSION:
        raise UnsupportedQuantizationConfig(
            f"the checkpoint's eightbit section has version {ours['version']}, newer than this eightbit reads"
        )
    try:
        kv = KVCacheScheme(**ours.get("kv_cache", {}))
    except TypeError as e:
        raise UnsupportedQuantizationConfig(f"eightbit.kv_cache is malformed: {e}") from e
    except ValueError as e:
        raise UnsupportedQuantizationConfig(str(e)) from e
    return QuantScheme(WeightScheme(), ActivationScheme(), kv, ignore)


def read_calibration_summary(config) -> dict | None:
    """The calibration record our converter stored (text, samples, alpha per layer, errors), if any."""
    qc = _get(config, "quantization_config")
    if not isinstance(qc, dict):
        return None
    ours = qc.get(EIGHTBIT_KEY)
    return ours.get("calibration") if isinstance(ours, dict) else None
