"""`eightbit quantize SRC OUT`, and the same as a Python function `quantize(...)`."""

import argparse
import sys
from pathlib import Path

from eightbit.quant.errors import QuantizeError
from eightbit.quant.schemes import DEFAULT_KV_GROUP_SIZE

DEFAULT_NUM_SAMPLES = 128
DEFAULT_SEQ_LEN = 512


def _parse_alpha(value):
    if value is None or value == "auto":
        return value
    if isinstance(value, str) and value.lower() in ("none", "off"):
        return None
    try:
        a = float(value)
    except (TypeError, ValueError):
        raise QuantizeError(f"alpha must be 'auto', 'none' or a number in [0, 1], got {value!r}") from None
    if not 0.0 <= a <= 1.0:
        raise QuantizeError(f"alpha must be in [0, 1], got {a}")
    return a


def quantize(
    src=None,
    out=None,
    *,
    calib_data=None,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    seq_len: int | None = None,
    alpha="auto",
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
    overwrite: bool = False,
    progress: bool = True,
    device="auto",
    **convert_options,
) -> dict:
    """Quantize `src` (HF checkpoint dir, GGUF file, or None for the embedded SmolLM2) to W8A8 in `out`.

    calib_data: a text file or "hf:NAME[:CONFIG][:SPLIT]"; None finds WikiText-2 valid
    (see calibrate.data). alpha: "auto" (per layer and point, from a grid), a float, or None.
    device: where calibration runs ("auto": the GPU if there is one, else the CPU). seq_len: tokens per
    calibration window (None: DEFAULT_SEQ_LEN, or the model's context where that is shorter).
    convert_options (quant.convert.convert's): max_shard_bytes, sample_tokens (the calibration tokens the error of
    each alpha is measured on), batch_size (calibration windows a forward), alpha_grid (the alphas "auto" tries).
    Returns the calibration summary written into the checkpoint. Raises QuantizeError
    (a ValueError) on bad input; on any failure `out` is left untouched.
    """
    from eightbit.calibrate.data import default_calibration_source, load_calibration_text, make_windows
    from eightbit.engine.weights import CheckpointError, open_checkpoint
    from eightbit.quant.convert import check_convert_options, convert
    from eightbit.quant.hf_layers import check_source
    from eightbit.quant.schemes import KVCacheScheme, head_dim
    from eightbit.quant.writer import check_output_path, leftover_temp_dirs

    if out is None:
        raise QuantizeError("no output directory given")
    out = Path(out)
    alpha = _parse_alpha(alpha)
    check_output_path(out, overwrite)  # first: no file read (_check_sizes reads a GGUF's config: ~3 s for SmolLM2)
    seq_len = _check_sizes(src, num_samples, seq_len, kv_group_size)
    check_convert_options(**convert_options)
    leftovers = leftover_temp_dirs(out)
    if leftovers:
        print(f"note: {', '.join(p.name for p in leftovers)} in {out.resolve().parent} were left by an earlier run "
              f"that was killed or could not move its checkpoint into place (its error named the folder holding "
              f"it), or are being written by one still running: remove them once nothing in them is needed",
              file=sys.stderr, flush=True)
    device = _resolve_device(device)
    source = calib_data if calib_data is not None else default_calibration_source()
    text = load_calibration_text(str(source))  # before the (slow) model: fail fast on bad data
    try:
        checkpoint = open_checkpoint(src)
    except CheckpointError as e:
        raise QuantizeError(str(e)) from e
    check_source(checkpoint)
    try:
        KVCacheScheme(group_size=kv_group_size).check_head_dim(head_dim(checkpoint.config))
    except ValueError as e:
        raise QuantizeError(str(e)) from e
    try:
        tokenizer = checkpoint.load_tokenizer()
    except Exception as e:
        raise QuantizeError(f"cannot load the tokenizer of {checkpoint.source}: {e}") from e
    calibration = make_windows(text, tokenizer, num_samples, seq_len, progress=progress)
    if calibration.num_samples < num_samples:
        print(f"note: the calibration text holds {calibration.num_samples} windows of {seq_len} tokens, fewer than "
              f"the {num_samples} asked for: calibrating on those", file=sys.stderr, flush=True)
    return convert(
        checkpoint, out, calibration, alpha=alpha, kv_group_size=kv_group_size, overwrite=overwrite,
        progress=progress, tokenizer=tokenizer, device=device, **convert_options,
    )


def _check_sizes(src, num_samples, seq_len, kv_group_size) -> int:
    """The numeric options, checked before the model loads (a GGUF's weights take ~20 s); returns the window
    length (seq_len None: DEFAULT_SEQ_LEN, or the model's context where that is shorter)."""
    from eightbit.quant.schemes import KV_GROUP_SIZES, KVCacheScheme, head_dim

    from eightbit.engine.models.llama import context_limit

    config = _config_only(src)
    context = context_limit(config) if getattr(config, "max_position_embeddings", None) else None
    if seq_len is None:
        seq_len = DEFAULT_SEQ_LEN if context is None else min(DEFAULT_SEQ_LEN, context)
    if num_samples < 1 or seq_len < 2:
        raise QuantizeError(f"need num_samples >= 1 and seq_len >= 2, got {num_samples} and {seq_len}")
    try:
        kv = KVCacheScheme(group_size=kv_group_size)
        if kv_group_size not in KV_GROUP_SIZES and config is not None:  # it can only be head_dim
            kv.check_head_dim(head_dim(config))
    except ValueError as e:
        raise QuantizeError(str(e)) from e
    if context is not None and seq_len > context:  # calibrated at positions the model never sees
        raise QuantizeError(f"--seq-len {seq_len} is longer than the model's context of {context} tokens: "
                            f"pass --seq-len {context} or less")
    return seq_len


def _config_only(src):
    """The source's config read without its weights, or None where open_checkpoint will say what is wrong."""
    from transformers import AutoConfig

    from eightbit.engine import gguf_cache
    from eightbit.engine.weights import embedded_model_path

    try:
        path = embedded_model_path() if src is None else Path(src)
        if path.is_file() and path.suffix == ".gguf":
            converted = gguf_cache.lookup(path)  # its config.json, without parsing the GGUF again
            if converted is not None:
                return AutoConfig.from_pretrained(converted)
            return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if (path / "config.json").is_file():
            return AutoConfig.from_pretrained(path)
    except Exception:
        pass
    return None


def _resolve_device(device):
    import torch

    from eightbit.engine.config import checked_device

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return checked_device(device)  # only what calibration runs on: mps and meta failed with tracebacks later
    except ValueError as e:
        raise QuantizeError(f"--device: {e}") from None


MODEL_FILE_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")

HELP = """\
Quantize a Llama-family model (llama, mistral, qwen2 without sliding window) to an int8 W8A8
checkpoint in the compressed-tensors format (vLLM reads it too): Linear weights int8 per output
channel, activations int8 per token at run time, SmoothQuant folded into norms and weights,
and eightbit's int8 KV-cache scheme recorded in config.json. Runs layer by layer, so models
larger than RAM convert from HF safetensors (a GGUF is first converted whole, in memory, by
transformers). OUT is written atomically: a failed or interrupted run (Ctrl-C,
SIGTERM, SIGHUP) leaves nothing.

  eightbit quantize SRC OUT    quantize SRC into OUT
  eightbit quantize OUT        quantize the embedded SmolLM2-135M-Instruct into OUT (one path is
                               always OUT, even if it exists; rerun with --overwrite to replace it;
                               a name ending in .gguf or .safetensors is refused as OUT)
"""

CALIB_HELP = """calibration text: a local text file, or hf:NAME[:CONFIG][:SPLIT] for a `datasets`
source (its 'text' column; split defaults to validation). Default: $EIGHTBIT_CALIB_DATA, else
WikiText-2 raw validation at ../shared/data/wikitext-2/wiki.valid.raw beside the source tree
(only an editable install has one); if neither exists, this option is required. Never calibrate on text you evaluate on."""


def add_quantize_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("quantize", help="quantize a model to int8 W8A8", description=HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", nargs="?", default=None, metavar="SRC",
                   help="HF checkpoint directory or .gguf file (omitted: the embedded SmolLM2-135M-Instruct; "
                   "with one path, that path is always OUT)")
    p.add_argument("out", nargs="?", default=None, metavar="OUT",
                   help="output directory: must not exist, or with --overwrite be empty or an earlier "
                   "`eightbit quantize` output")
    p.add_argument("--calib-data", default=None, help=CALIB_HELP)
    p.add_argument("--num-samples", type=int, default=DEFAULT_NUM_SAMPLES,
                   help=f"calibration windows (default {DEFAULT_NUM_SAMPLES})")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per calibration window (default {DEFAULT_SEQ_LEN}, or the model's context if shorter)")
    p.add_argument("--alpha", default="auto",
                   help="SmoothQuant migration strength: 'auto' (chosen per layer and smoothing point by "
                   "measured W8A8 error, the default), a number in [0, 1], or 'none' (no smoothing)")
    p.add_argument("--kv-group-size", type=int, default=DEFAULT_KV_GROUP_SIZE,
                   help=f"int8 KV cache group size along head_dim: 8, 16, 32, 64 or head_dim "
                   f"(default {DEFAULT_KV_GROUP_SIZE})")
    p.add_argument("--device", default="auto",
                   help="where calibration runs: 'auto' (a CUDA GPU if present, else the CPU), 'cpu', 'cuda', 'cuda:1'")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is an empty folder or an eightbit checkpoint (config.json with "
                   "eightbit's quantization_config, and only checkpoint files); anything else is refused")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_quantize, interrupt_note="OUT is as it was before the run (written atomically)")
    return p


def run_quantize(args) -> int:
    """Run a parsed `quantize` command. Returns the exit status (0, or 2 on a QuantizeError)."""
    try:
        out, summary = _quantize_args(args)
    except QuantizeError as e:
        print(f"eightbit quantize: error: {e}", file=sys.stderr)
        return 2
    args.interrupt_note = f"{out} holds the new checkpoint, complete"  # a Ctrl-C during the report
    _report(out, summary)
    return 0


def _quantize_args(args):
    """quantize() with the command's arguments: (OUT, summary)."""
    src, out = args.src, args.out
    if src is None:
        raise QuantizeError("missing OUT")
    if out is None:  # one path is always OUT, the embedded model quantized into it
        src, out = None, src
        if Path(out).exists() and not args.overwrite:
            raise QuantizeError(f"{out} already exists: pass --overwrite to replace it (one path is OUT, for the "
                                f"embedded model; to quantize {out}, give SRC and OUT)")
        if Path(out).suffix.lower() in MODEL_FILE_SUFFIXES:  # a source not there yet, or mistyped
            raise QuantizeError(f"{out} is named like a model file, but one path is OUT (the embedded model is "
                                f"quantized into it): to quantize {out}, give SRC and OUT")
        print(f"no SRC given: quantizing the embedded SmolLM2-135M-Instruct into {out}", flush=True)
    if args.no_progress:  # transformers' own bars too (its GGUF conversion has one)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    return out, quantize(
        src, out, calib_data=args.calib_data, num_samples=args.num_samples, seq_len=args.seq_len,
        alpha=args.alpha, kv_group_size=args.kv_group_size, overwrite=args.overwrite,
        progress=not args.no_progress, device=args.device,
    )


def _report(out, summary) -> None:
    errs, base = summary["mean_error"], summary["mean_error_unsmoothed"]
    print(f"wrote {out}")
    print("mean W8A8 relative error per smoothing point (unsmoothed -> smoothed): "
          + ", ".join(f"{p} {base[p]:.2e} -> {errs[p]:.2e}" for p in errs))


def main(argv=None) -> int:
    """`python -m eightbit.quant.cli SRC OUT` = `eightbit quantize SRC OUT`."""
    from eightbit.cli import main as eightbit_main

    return eightbit_main(["quantize", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
