"""Calibration text: where it comes from, and how it becomes fixed-length token windows.

A source is either
  * a local UTF-8 text file (universal newlines: the text `datasets.load_dataset("text", data_files=...)` gives,
    without needing a writable `datasets` cache), or
  * `hf:NAME[:CONFIG][:SPLIT]`: anything `datasets.load_dataset(NAME, CONFIG, split=SPLIT)`
    accepts (a hub dataset, or a local folder of .txt/.parquet/... files); its "text" column
    is used and SPLIT defaults to "validation".

With no source given, the WikiText-2 raw *validation* split is used if it can be found: the
file named by $EIGHTBIT_CALIB_DATA, else `../shared/data/wikitext-2/wiki.valid.raw` beside the
source tree. Never calibrate on the text you evaluate on (eightbit evaluates on the test split).

The text is tokenized once (in pieces of about TOKENIZE_CHARS characters, split after a line: a fast tokenizer
takes ~150 bytes of memory per character in one call) and cut into `num_samples` windows of `seq_len` tokens, spread
evenly over the whole text (non-overlapping); each window starts with BOS when the
tokenizer adds one, as the model sees text at inference.
"""

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from eightbit.quant.errors import QuantizeError

ENV_VAR = "EIGHTBIT_CALIB_DATA"
WIKITEXT_VALID = Path("shared") / "data" / "wikitext-2" / "wiki.valid.raw"
HF_PREFIX = "hf:"
TOKENIZE_CHARS = 4_000_000  # WikiText-2's validation text (1.1 M characters) is one piece


def default_calibration_source() -> str:
    """$EIGHTBIT_CALIB_DATA, else WikiText-2 valid beside the source tree; else a QuantizeError."""
    env = os.environ.get(ENV_VAR)
    if env:
        return env
    repo_parent = Path(__file__).resolve().parents[2]  # <repo>/calibrate/data.py -> the folder holding <repo>
    candidate = repo_parent / WIKITEXT_VALID
    if candidate.is_file():
        return str(candidate)
    raise QuantizeError(
        "no calibration data: pass --calib-data (a text file such as WikiText-2's wiki.valid.raw, or "
        f"hf:NAME[:CONFIG][:SPLIT] for a `datasets` source), or set ${ENV_VAR}"
    )


@dataclass
class CalibrationText:
    text: str
    source: str  # as given: a path or hf:...
    sha256: str  # of the UTF-8 text, so the checkpoint records exactly what calibrated it


def load_calibration_text(source: str) -> CalibrationText:
    """Read the whole calibration text of a source (see the module docstring)."""
    if source.startswith(HF_PREFIX):
        import datasets

        datasets.logging.set_verbosity_error()
        datasets.disable_progress_bars()
        parts = source[len(HF_PREFIX):].split(":")
        if not parts[0] or len(parts) > 3:
            raise QuantizeError(f"bad calibration source {source!r}: expected hf:NAME[:CONFIG][:SPLIT]")
        name, config, split = (parts + [None, None])[:3]
        try:
            ds = datasets.load_dataset(name, config or None, split=split or "validation")
        except Exception as e:
            raise QuantizeError(f"cannot load calibration dataset {source!r}: {e}") from e
        if "text" not in ds.column_names:
            raise QuantizeError(f"calibration dataset {source!r} has no 'text' column (columns: {ds.column_names})")
        text = "".join(row if row.endswith("\n") else row + "\n" for row in ds["text"])
    else:
        path = Path(source)
        if not path.is_file():
            why = ("is a folder: pass a text file in it" if path.is_dir() else
                   "is not a regular file (a device or a pipe): pass a text file" if path.exists() else "does not exist")
            raise QuantizeError(f"calibration file {path} {why}")
        if path.stat().st_size == 0:
            raise QuantizeError(f"calibration file {path} is empty")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            bad = e.object[e.start:e.start + 8]
            raise QuantizeError(f"calibration file {path} is not UTF-8 text ({e.reason}: {bad!r})") from e
        except OSError as e:
            raise QuantizeError(f"cannot read calibration file {path}: {e}") from e
        source = str(path.resolve())
    if not text.strip():
        raise QuantizeError(f"calibration source {source!r} holds no text")
    return CalibrationText(text, source, hashlib.sha256(text.encode("utf-8")).hexdigest())


@dataclass
class CalibrationSet:
    input_ids: torch.Tensor  # [num_samples, seq_len] int64
    source: str
    sha256: str
    text_tokens: int  # tokens in the whole text

    @property
    def num_samples(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def summary(self) -> dict:
        return {
            "source": self.source,
            "sha256": self.sha256,
            "text_tokens": self.text_tokens,
            "num_samples": self.num_samples,
            "seq_len": self.seq_len,
            "tokens": self.num_samples * self.seq_len,
        }


def make_windows(text: CalibrationText, tokenizer, num_samples: int, seq_len: int, progress=False) -> CalibrationSet:
    """Tokenize the text and take up to num_samples evenly spread, non-overlapping windows.

    Fewer windows are taken when the text is too short for num_samples of them; a text
    shorter than one window is an error."""
    from tqdm.auto import tqdm

    if num_samples < 1 or seq_len < 2:
        raise QuantizeError(f"need num_samples >= 1 and seq_len >= 2, got {num_samples} and {seq_len}")
    level = logging.getLogger("transformers.tokenization_utils_base").level
    logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)  # "longer than max length"
    ids = []
    try:
        pieces = text_pieces(text.text, TOKENIZE_CHARS)
        for piece in tqdm(pieces, desc="tokenizing the calibration text", unit="piece",
                          disable=not progress or len(pieces) < 2):
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    finally:
        logging.getLogger("transformers.tokenization_utils_base").setLevel(level)
    bos = _bos_id(tokenizer)
    body = seq_len - (bos is not None)
    available = len(ids) // body
    if available < 1:
        raise QuantizeError(
            f"calibration text {text.source!r} has {len(ids)} tokens, fewer than one window of {seq_len}: "
            "give more text or a smaller --seq-len"
        )
    n = min(num_samples, available)
    # window k starts at round(k * (len - body) / (n - 1)): first at 0, last ending at the end
    span = len(ids) - body
    starts = [0] if n == 1 else [round(k * span / (n - 1)) for k in range(n)]
    t = torch.tensor(ids, dtype=torch.long)
    windows = torch.stack([t[s: s + body] for s in starts])
    if bos is not None:
        windows = torch.cat([torch.full((n, 1), bos, dtype=torch.long), windows], dim=1)
    return CalibrationSet(windows, text.source, text.sha256, len(ids))


def text_pieces(text: str, size: int) -> list[str]:
    """text cut into pieces of at least `size` characters (the last may be shorter), each ending after a line."""
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size - 1)
        end = len(text) if end < 0 else end + 1
        pieces.append(text[start:end])
        start = end
    return pieces


def _bos_id(tokenizer):
    """The BOS id if the tokenizer puts one in front of text by default, else None."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    probe = tokenizer("a")["input_ids"]
    return bos if probe and probe[0] == bos else None
