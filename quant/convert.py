"""Float checkpoint -> eightbit W8A8 checkpoint, one decoder layer at a time.

For each decoder layer: load its tensors (float32) from the source, push the calibration
hidden states through it with hooks on every Linear input (per-channel absmax and a token
sample), choose and fold the SmoothQuant factors, quantize its Linear weights per output
channel, append its tensors to the output shards, and free it. The next layer's inputs are
the *float* layer's outputs: smoothing is exact, so they are the original model's hidden
states, every layer is calibrated on the statistics the float model really has, and each
layer's measured error is against the true float reference rather than against inputs
already bent by earlier layers' quantization (and one forward per layer suffices).

Memory: one float32 decoder layer, the calibration hidden states (num_samples x seq_len x
hidden x 4 bytes, twice), and the shard being filled (<= 2 GB); never the whole model.
With device="cuda" the layer and the hidden states live on the GPU, the shard on the CPU.

Output (see quant/checkpoint_format.py for quantization_config):
    config.json               the source config + architectures + dtype bfloat16 + quantization_config
    generation_config.json
    tokenizer files           tokenizer.save_pretrained
    model*.safetensors        <linear>.weight int8 [out, in], <linear>.weight_scale float32 [out, 1],
                              <linear>.bias, norms, embed_tokens, lm_head (if untied) in bfloat16
"""

import copy
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from eightbit.calibrate.smoothquant import ALPHA_GRID, POINTS, smooth_layer
from eightbit.calibrate.stats import collect_layer_stats
from eightbit.quant.checkpoint_format import build_quantization_config
from eightbit.quant.errors import QuantizeError
from eightbit.quant.hf_layers import DecoderLayers, architecture
from eightbit.quant.int8 import quantize_per_channel
from eightbit.quant.schemes import KVCacheScheme, QuantScheme, head_dim
from eightbit.quant.writer import DEFAULT_SHARD_BYTES, ShardWriter, atomic_output_dir

FLOAT_DTYPE = torch.bfloat16  # non-Linear tensors: what the engine computes in


def _finite(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise QuantizeError(f"tensor {name!r} holds NaN or inf values")
    return t


def _write_layer(writer: ShardWriter, prefix: str, layer: torch.nn.Module) -> None:
    """Linear weights -> int8 + float32 scale; everything else (norms, biases) -> bfloat16."""
    linears = {n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, p in layer.named_parameters():
        full = prefix + name
        module, _, kind = name.rpartition(".")
        _finite(full, p)
        if module in linears and kind == "weight":
            q, scale = quantize_per_channel(p.data)
            writer.add(full, q)
            writer.add(prefix + module + ".weight_scale", scale)
        else:
            writer.add(full, p.data.to(FLOAT_DTYPE))


def check_convert_options(max_shard_bytes=DEFAULT_SHARD_BYTES, sample_tokens=2048, batch_size=8,
                          alpha_grid=ALPHA_GRID) -> None:
    """Raise QuantizeError for an option convert() cannot use (a TypeError names an unknown one)."""
    for name, value in (("max_shard_bytes", max_shard_bytes), ("sample_tokens", sample_tokens),
                        ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise QuantizeError(f"{name} must be an int >= 1, got {value!r}")
    try:
        grid = [float(a) for a in alpha_grid]
    except (TypeError, ValueError):
        grid = None
    if not grid or not all(0.0 <= a <= 1.0 for a in grid):
        raise QuantizeError(f"alpha_grid must be a non-empty sequence of numbers in [0, 1], got {alpha_grid!r}")


def convert(
    checkpoint,
    out,
    calibration,
    *,
    alpha="auto",
    kv_group_size: int = 32,
    overwrite: bool = False,
    progress: bool = True,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    sample_tokens: int = 2048,
    batch_size: int = 8,
    tokenizer=None,
    device="cpu",
    alpha_grid=ALPHA_GRID,
) -> dict:
    """Write the W8A8 checkpoint of `checkpoint` (engine.weights.Checkpoint) to `out`.

    calibration: a calibrate.data.CalibrationSet. alpha: "auto", a float in [0, 1], or None
    (no smoothing). device: where calibration runs, one float32 layer at a time (the result
    differs from the CPU's only by float rounding). Returns the calibration summary stored
    in the checkpoint.
    """
    check_convert_options(max_shard_bytes, sample_tokens, batch_size, alpha_grid)
    config = checkpoint.config
    kv = KVCacheScheme(group_size=kv_group_size)
    try:
        kv.check_head_dim(head_dim(config))
    except ValueError as e:
        raise QuantizeError(str(e)) from e
    scheme = QuantScheme(kv_cache=kv)
    layers = DecoderLayers(checkpoint, device)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    tied = bool(getattr(config, "tie_word_embeddings", False))
    started = time.time()

    with atomic_output_dir(out, overwrite) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        embed = checkpoint.get_tensor("model.embed_tokens.weight")  # present, shaped and finite: DecoderLayers checked
        if calibration.input_ids.max() >= embed.shape[0]:
            raise QuantizeError("the calibration tokens exceed the model's vocabulary: tokenizer and model disagree")
        hidden = F.embedding(calibration.input_ids.to(device), embed.to(device, torch.float32))
        writer.add("model.embed_tokens.weight", embed.to(FLOAT_DTYPE))
        del embed

        records = []
        with tqdm(total=len(layers), desc="quantize layers", unit="layer", disable=not progress) as bar:
            for i in range(len(layers)):
                prefix = layers.prefix(i)
                layer = layers.load(i)
                stats, hidden_next = collect_layer_stats(
                    layer, layers.run, hidden, sample_tokens=sample_tokens, batch_size=batch_size,
                    layer_name=prefix.rstrip("."),
                )
                record = smooth_layer(layer, stats, alpha, heads, kv_heads, alpha_grid)
                _write_layer(writer, prefix, layer)
                layers.release(i)
                del stats, layer
                hidden = hidden_next
                records.append(record)
                # the finished layer's alpha at each smoothing point ("none": leaving it unsmoothed measured best),
                # shown with its own count (set before the update, it stood beside the count of the layers before)
                bar.set_postfix({p: ("none" if r["alpha"] is None else r["alpha"]) for p, r in record.items()},
                                refresh=False)
                bar.update(1)
        del hidden

        _add_tail(writer, checkpoint, tied)
        summary = _summary(calibration, alpha, alpha_grid, sample_tokens, records, time.time() - started, device)
        summary["source_model"] = source_model(checkpoint)
        tokenizer = tokenizer or checkpoint.load_tokenizer()
        try:  # a full disk here is as clear as in the shards' writes (ShardWriter.flush)
            writer.close()
            _write_config(tmp, config, build_quantization_config(scheme, summary))
            if checkpoint.generation_config is not None:
                checkpoint.generation_config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        except OSError as e:
            raise QuantizeError(f"cannot write the checkpoint in {tmp}: {e}") from None
    return summary


def _add_tail(writer, checkpoint, tied) -> None:
    """The final norm, and lm_head unless it is the embedding's (present, shaped and finite: DecoderLayers checked)."""
    for name in ["model.norm.weight"] + ([] if tied else ["lm_head.weight"]):
        writer.add(name, checkpoint.get_tensor(name).to(FLOAT_DTYPE))


def source_model(checkpoint) -> str:
    """What a checkpoint records as the model it was made from: the resolved path the user named (a GGUF file, not
    the directory of its converted copy)."""
    return str(Path(checkpoint.source).resolve())


def _summary(calibration, alpha, alpha_grid, sample_tokens, records, seconds, device) -> dict:
    def mean(key, point):
        return sum(r[point][key] for r in records) / len(records)

    return {
        "data": calibration.summary(),
        "method": "smoothquant",
        "alpha": alpha if alpha in ("auto", None) else float(alpha),
        "alpha_grid": [float(a) for a in alpha_grid] if alpha == "auto" else None,
        "error_metric": "relative squared error of the W8A8 linear outputs vs float, summed over the point's "
        "Linears, on the sampled calibration tokens",
        "sample_tokens": sample_tokens,
        "next_layer_inputs": "float",
        "mean_error": {p.name: mean("error", p.name) for p in POINTS},
        "mean_error_unsmoothed": {p.name: mean("error_unsmoothed", p.name) for p in POINTS},
        "layers": records,
        "seconds": round(seconds, 1),
        "device": str(device),
    }


def _write_config(folder: Path, config, quantization_config: dict) -> None:
    d = copy.deepcopy(config).to_dict()
    d.pop("quantization_config", None)
    d.pop("torch_dtype", None)
    if not d.get("architectures"):
        d["architectures"] = [architecture(config)]
    d["dtype"] = "bfloat16"
    d["quantization_config"] = quantization_config
    (Path(folder) / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
