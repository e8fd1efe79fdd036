"""The named configurations an eval compares, the data folder, and the engine-side scorer.

A configuration is a backend ("engine" = eightbit's `LLM`, "hf" = HF transformers, see
peers.py) plus its precision settings. Every scorer answers one question,
`loglikelihood(requests)`: for each (token ids, start) it returns the summed log-prob of
tokens[start:] given everything before them, and whether each of those tokens was the argmax.
Perplexity and the tasks are both built on that one call, so every configuration is scored on
exactly the same token ids.
"""

from __future__ import annotations

import atexit
import gc
import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ENV_DATA = "EIGHTBIT_DATA"
ENV_SQ_CHECKPOINT = "EIGHTBIT_SQ_CHECKPOINT"
WIKITEXT_VALID = "wikitext-2/wiki.valid.raw"  # the SmoothQuant checkpoint's calibration text


# --- data ---------------------------------------------------------------------------------


def resolve_data_dir(explicit=None) -> Path:
    """--data-dir, else $EIGHTBIT_DATA, else <repo>/../shared/data if it exists, else a clear error."""
    if explicit is not None:
        if not str(explicit).strip():
            raise ValueError("--data-dir is empty")
        path = Path(explicit)
        if not path.is_dir():
            raise FileNotFoundError(f"--data-dir {path} is not a directory")
        return path
    env = os.environ.get(ENV_DATA)
    if env:
        path = Path(env)
        if not path.is_dir():
            raise FileNotFoundError(f"${ENV_DATA}={env} is not a directory")
        return path
    repo = Path(__file__).resolve().parents[1]  # <repo>/eval/configs.py
    candidate = repo.parent / "shared" / "data"
    if candidate.is_dir():
        return candidate
    raise FileNotFoundError(
        f"no eval data: pass --data-dir, set ${ENV_DATA}, or put the data in {candidate} "
        "(it holds wikitext-2/, lambada/, hellaswag/, arc-easy/)"
    )


def data_file(data_dir: Path, relative: str) -> Path:
    path = Path(data_dir) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (data dir {data_dir})")
    return path


# sha256 of the published files (../shared/data/*/README.md gives each one's source)
PUBLISHED_SHA256 = {
    "wikitext-2/wiki.test.raw": "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08",
    "lambada/lambada_test.jsonl": "4aa8d02cd17c719165fc8a7887fddd641f43fcafa4b1c806ca8abc31fabdb226",
    "hellaswag/hellaswag_val_full.txt": "d572539320eb2050e858ca34b495bbe2103e3b3f1391a9c3bcdf215b0bb93bd1",
    "arc-easy/ARC-Easy-Test.jsonl": "1d47e415603543fa371f8990b14926a7e18b7874f455f6ea1a97a7ac749ff409",
}


def data_record(data_dir: Path, relative: str) -> dict:
    """Which file a result was scored on: its path, size, sha256, and whether it is the published copy (a copy
    with other line ends or edits scores differently under the same task name)."""
    path = data_file(data_dir, relative)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"file": str(path.resolve()), "bytes": path.stat().st_size, "sha256": sha,
            "published": sha == PUBLISHED_SHA256.get(relative)}


def unpublished_note(records: dict) -> str:
    """'' when every data file is the published copy, else a note naming those that are not."""
    other = [f"{name} ({Path(r['file']).name}, sha256 {r['sha256'][:12]}…)" for name, r in records.items()
             if not r["published"]]
    return f"not the published data: {', '.join(other)}" if other else ""


# --- configurations -----------------------------------------------------------------------


@dataclass(frozen=True)
class EvalConfig:
    name: str
    backend: str  # "engine" or "hf"
    dtype: str = "bfloat16"  # activations / float weights
    weights: str = "float"  # float | rtn (W8A8 on load) | smoothquant (quantize() checkpoint) | bnb-int8 | torchao-int8
    kv_cache_dtype: str = "auto"
    kv_group_size: int | None = None
    baseline: str = "bf16"  # the row its Δ% is measured against
    description: str = ""

    @property
    def w8a8(self) -> bool:
        return self.weights != "float"


def _engine(name, description, **kw):
    return EvalConfig(name, "engine", description=description, **kw)


def _hf(name, description, **kw):
    return EvalConfig(name, "hf", baseline="hf-bf16", description=description, **kw)


CONFIGS = {
    c.name: c
    for c in [
        _engine("fp32", "eightbit, float32 weights/activations/KV", dtype="float32"),
        _engine("bf16", "eightbit, bf16 weights/activations/KV (the baseline)"),
        _engine("kv8", "eightbit bf16 + int8 KV cache (default group size 32)", kv_cache_dtype="int8"),
        *[
            _engine(f"kv8-g{g}", f"eightbit bf16 + int8 KV cache, group size {g}", kv_cache_dtype="int8",
                    kv_group_size=g)
            for g in (8, 16, 32, 64)
        ],
        _engine("w8a8-rtn", "eightbit W8A8, round-to-nearest on load (no smoothing)", weights="rtn"),
        _engine("w8a8-sq", "eightbit W8A8, SmoothQuant checkpoint from `eightbit quantize`", weights="smoothquant"),
        _engine("w8a8-rtn+kv8", "W8A8 round-to-nearest + int8 KV", weights="rtn", kv_cache_dtype="int8"),
        _engine("w8a8-sq+kv8", "W8A8 SmoothQuant checkpoint + int8 KV", weights="smoothquant",
                kv_cache_dtype="int8"),
        _hf("hf-fp32", "HF transformers, float32", dtype="float32"),
        _hf("hf-bf16", "HF transformers, bf16 (the peers' baseline)"),
        _hf("bnb-int8", "HF + bitsandbytes LLM.int8 (BitsAndBytesConfig(load_in_8bit=True))", weights="bnb-int8"),
        _hf("torchao-int8", "HF + torchao Int8DynamicActivationInt8WeightConfig", weights="torchao-int8"),
    ]
}

GROUPS = {
    "default": ["fp32", "bf16", "kv8", "w8a8-rtn", "w8a8-sq", "w8a8-rtn+kv8", "w8a8-sq+kv8",
                "hf-fp32", "hf-bf16", "bnb-int8", "torchao-int8"],
    "engine": ["fp32", "bf16", "kv8", "w8a8-rtn", "w8a8-sq", "w8a8-rtn+kv8", "w8a8-sq+kv8"],
    "peers": ["hf-fp32", "hf-bf16", "bnb-int8", "torchao-int8"],
    "kv-sweep": ["bf16", "kv8-g8", "kv8-g16", "kv8-g32", "kv8-g64"],
    "parity": ["fp32", "hf-fp32", "bf16", "hf-bf16"],
}


def parse_configs(spec: str) -> list[EvalConfig]:
    """"default", "a,b,c", or groups and names mixed ("parity,kv-sweep"); order kept, duplicates dropped."""
    names = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        expanded = GROUPS.get(part, [part])
        for name in expanded:
            if name not in CONFIGS:
                raise ValueError(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}; "
                                 f"groups: {', '.join(GROUPS)}")
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError("no configurations given")
    return [CONFIGS[n] for n in names]


# --- scoring ------------------------------------------------------------------------------


@dataclass
class Score:
    logprob: float  # sum over the scored tokens
    greedy: bool  # every scored token was the argmax (only when asked for, else False)
    num_tokens: int


def check_finite(scores, name) -> None:
    """A model whose log-likelihoods are NaN or infinite has failed: its greedy matches and argmaxes would be
    numbers that were never measured (NaN compares false: LAMBADA would count every token as greedy)."""
    bad = sum(not math.isfinite(s.logprob) for s in scores)
    if bad:
        raise ValueError(f"{name}: {bad} of {len(scores)} requests scored a log-likelihood that is NaN or "
                         "infinite: the model's logits are not finite")


@dataclass
class Scorer:
    """Base class: a loaded model that scores (token ids, start) requests."""

    config: EvalConfig
    weight_bytes: int = 0
    kv_bytes_per_token: float = 0.0
    info: dict = field(default_factory=dict)

    def loglikelihood(self, requests, need_greedy=False, progress=None) -> list[Score]:
        raise NotImplementedError

    def close(self):
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # pragma: no cover
            pass


def _batches(requests, max_tokens):
    """Consecutive index batches of at most max_tokens tokens (one oversized request goes alone)."""
    batch, size = [], 0
    for i, (tokens, _) in enumerate(requests):
        if batch and size + len(tokens) > max_tokens:
            yield batch
            batch, size = [], 0
        batch.append(i)
        size += len(tokens)
    if batch:
        yield batch


def score_from_prompt_logprobs(tokens, start, prompt_logprobs, need_greedy) -> Score:
    """Sum the engine's per-position {token_id: logprob} dicts over tokens[start:].

    With prompt_logprobs=1 each dict holds the actual token and the top-1 one; the actual token
    is the argmax iff no entry beats it (ties count as greedy, as with lm-eval's argmax match
    on equal logits being measure-zero)."""
    total, greedy = 0.0, True
    for i in range(start, len(tokens)):
        entry = prompt_logprobs[i]
        lp = entry[tokens[i]]
        total += lp
        if need_greedy and any(not lp >= v for t, v in entry.items() if t != tokens[i]):  # NaN: not greedy
            greedy = False
    return Score(total, greedy and need_greedy, len(tokens) - start)


class EngineScorer(Scorer):
    """eightbit's `LLM`, scored through `SamplingParams(prompt_logprobs=...)`."""

    def __init__(self, config: EvalConfig, model=None, device=None, sq_checkpoint=None, kv_cache_memory_gb=None,
                 max_batch_tokens=16384, max_model_len=2048, llm=None):
        """Build the `LLM` of `config`, or wrap an existing one (`llm`, e.g. a test's shared engine)."""
        from eightbit import LLM

        super().__init__(config)
        path = model
        if config.weights == "smoothquant":
            if sq_checkpoint is None and llm is None:
                raise ValueError(f"configuration {config.name} needs a SmoothQuant checkpoint "
                                 f"(--sq-checkpoint DIR, made by `eightbit quantize` if missing)")
            path = str(sq_checkpoint)
        options = dict(dtype=config.dtype, device=device, kv_cache_dtype=config.kv_cache_dtype,
                       kv_group_size=config.kv_group_size,
                       quantization="w8a8" if config.weights == "rtn" else None, max_model_len=max_model_len)
        if kv_cache_memory_gb is not None:
            options["kv_cache_memory_gb"] = kv_cache_memory_gb
        self.llm = llm if llm is not None else LLM(path, **options)
        engine = self.llm.engine
        if config.w8a8 != engine.quantized:
            raise RuntimeError(f"{config.name}: the engine loaded {'W8A8' if engine.quantized else 'float'} "
                               f"weights for a {'W8A8' if config.w8a8 else 'float'} configuration")
        self.max_model_len = engine.max_model_len
        # on a CPU a batch of many windows runs no faster than one at a time (its matmuls are compute-bound
        # already), and the progress bar moved once per batch: every 8 windows, 12 minutes at 2k tokens
        cpu = str(engine.config.device) == "cpu"
        self.max_batch_tokens = min(max_batch_tokens, self.max_model_len) if cpu else max_batch_tokens
        self.kv_bytes_per_token = float(engine.kv_bytes_per_token)
        from eightbit.quant.schemes import weight_bytes

        float_bytes = 4 if config.dtype == "float32" else 2
        self.weight_bytes = int(weight_bytes(engine.hf_config, engine.quantized, float_bytes))
        self.info = {"model": path or "embedded SmolLM2-135M-Instruct", "device": str(engine.config.device)}
        if config.weights == "smoothquant":
            self.info["calibration"] = calibration_record(path)

    def loglikelihood(self, requests, need_greedy=False, progress=None) -> list[Score]:
        from eightbit import SamplingParams

        too_long = [len(t) for t, _ in requests if len(t) >= self.max_model_len]
        if too_long:
            raise ValueError(f"{len(too_long)} requests of up to {max(too_long)} tokens do not fit "
                             f"max_model_len={self.max_model_len}")
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1 if need_greedy else 0)
        scores = [None] * len(requests)
        for batch in _batches(requests, self.max_batch_tokens):
            outs = self.llm.generate([list(requests[i][0]) for i in batch], params, use_tqdm=False)
            for i, out in zip(batch, outs):
                tokens, start = requests[i]
                scores[i] = score_from_prompt_logprobs(tokens, start, out.prompt_logprobs, need_greedy)
            if progress is not None:
                progress.update(len(batch))
        return scores

    def close(self):
        self.llm = None
        super().close()


def build_scorer(config: EvalConfig, *, model=None, device=None, sq_checkpoint=None, **options) -> Scorer:
    if config.backend == "engine":
        return EngineScorer(config, model=model, device=device, sq_checkpoint=sq_checkpoint,
                            kv_cache_memory_gb=options.get("kv_cache_memory_gb"),
                            max_batch_tokens=options.get("max_batch_tokens", 16384),
                            max_model_len=options.get("max_model_len", 2048))
    from eightbit.eval.peers import HFScorer

    return HFScorer(config, model=model, device=device, max_batch_tokens=options.get("hf_batch_tokens", 4096))


def check_float_model(model=None) -> None:
    """Raise QuantizeError (a ValueError) if `model` is already quantized: every configuration quantizes
    the float model its own way (or not at all), so an int8 --model would run int8 under every name."""
    from eightbit.engine.weights import open_checkpoint
    from eightbit.quant.hf_layers import check_float

    check_float(open_checkpoint(model))


def calibration_record(sq_checkpoint) -> dict:
    """What a result row keeps of a SmoothQuant checkpoint's calibration (its full record stays in its config)."""
    from eightbit.quant.checkpoint_format import read_calibration_summary

    config = json.loads((Path(sq_checkpoint) / "config.json").read_text())
    summary = read_calibration_summary(config) or {}
    return {k: summary[k] for k in ("source_model", "data", "alpha", "sample_tokens") if k in summary}


def ensure_sq_checkpoint(path, model=None, progress=True, data_dir=None) -> Path:
    """The SmoothQuant W8A8 checkpoint at `path`, made with `quantize(model, path)` if it is not there.
    An existing one must have been made from `model` (its calibration record names the source).
    A new one calibrates on $EIGHTBIT_CALIB_DATA if set, else on data_dir's WikiText-2 valid split (the eval
    data's own copy; eval scores the test split), else on quantize's default."""
    path = Path(path)
    if (path / "config.json").is_file():
        _check_sq_source(path, model)
        return path
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()  # an empty folder made ahead: quantize writes the checkpoint in its place
    elif path.exists():
        raise ValueError(f"the SmoothQuant checkpoint {path} exists but holds no checkpoint (no config.json): "
                         f"remove it, or pass another --sq-checkpoint")
    from eightbit.calibrate.data import ENV_VAR
    from eightbit.quant.cli import quantize

    calib = None
    if not os.environ.get(ENV_VAR) and data_dir is not None and (Path(data_dir) / WIKITEXT_VALID).is_file():
        calib = str(Path(data_dir) / WIKITEXT_VALID)
    print(f"[eval] making the SmoothQuant checkpoint {path} (eightbit quantize, alpha=auto)", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)  # the default lives in a cache folder nothing else makes
    quantize(model, path, calib_data=calib, progress=progress)
    return path


def _check_sq_source(path: Path, model) -> None:
    from eightbit.engine.weights import open_checkpoint
    from eightbit.quant.convert import source_model

    recorded = calibration_record(path).get("source_model")
    wanted = source_model(open_checkpoint(model))
    if recorded is None:
        print(f"[eval] note: {path} does not record the model it was made from (an older eightbit made it); "
              f"using it as the SmoothQuant checkpoint of {wanted}", flush=True)
    elif recorded != wanted:
        raise ValueError(f"the SmoothQuant checkpoint {path} was made from {recorded}, not from {wanted}: "
                         f"pass --sq-checkpoint with one made from this model, or remove {path} to make it anew")


def default_sq_checkpoint_dir(model=None) -> Path:
    """$EIGHTBIT_SQ_CHECKPOINT, else a folder in eightbit's cache (engine/gguf_cache.cache_root: $EIGHTBIT_CACHE,
    $XDG_CACHE_HOME/eightbit or ~/.cache/eightbit) named after the model and a hash of its resolved path (two
    models of the same file name do not share one); with EIGHTBIT_CACHE=off, a temporary folder removed at exit."""
    env = os.environ.get(ENV_SQ_CHECKPOINT)
    if env:
        return Path(env)
    if model is None:
        tag = "smollm2-135m"
    else:
        digest = hashlib.sha256(str(Path(str(model)).resolve()).encode()).hexdigest()[:12]
        tag = f"{Path(str(model)).name.replace('.', '_')}-{digest}"
    from eightbit.engine.gguf_cache import cache_root

    root = cache_root()
    if root is None:
        root = Path(tempfile.mkdtemp(prefix="eightbit-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root / "eval" / f"{tag}-w8a8-smoothquant"


def load_tokenizer(model=None):
    """The base model's tokenizer (every configuration is fed the same token ids)."""
    from eightbit.engine.weights import open_checkpoint

    return open_checkpoint(model).load_tokenizer()
