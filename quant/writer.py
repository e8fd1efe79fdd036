"""Writing a checkpoint directory atomically, tensors streamed into ~2 GB safetensors shards.

`atomic_output_dir(out, overwrite)` yields a fresh temp dir beside `out`; only when the
block finishes is it given the umask's permissions and renamed to `out` (replacing an old `out`
if overwrite, which must be empty or an eightbit checkpoint: see `check_output_path`). Any
exception in the block, KeyboardInterrupt, SIGTERM and SIGHUP included, removes the temp dir, so a
failed run leaves nothing behind; a Ctrl-C while the finished checkpoint moves to `out` takes effect once it is
there (`InterruptedAfterMove` says so). A finished checkpoint that cannot be moved to `out` (something
appeared there meanwhile, or the rename failed) stays in the temp dir, and the error names it.
`ShardWriter` writes tensors in the order given, flushing a shard when it would pass the size
limit, and names them as transformers does (model.safetensors, or model-0000k-of-0000n with
model.safetensors.index.json).
"""

import json
import os
import re
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from eightbit.engine.gguf_cache import flush_to_disk
from eightbit.engine.signals import signals_deferred
from eightbit.quant.checkpoint_format import EIGHTBIT_KEY
from eightbit.quant.errors import QuantizeError

DEFAULT_SHARD_BYTES = 2 * 1024**3

# the files a checkpoint of ours consists of (the tokenizer's vary with its kind)
CHECKPOINT_FILES = {
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
}
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def check_output_path(out: Path, overwrite: bool) -> None:
    """Raise QuantizeError unless `out` may be written: new, or (with overwrite) replaceable, in a folder we may
    write in (checked before the model loads, not after)."""
    out = Path(out).resolve()  # a symlink is replaced at its target; "." by its absolute path
    if out.exists() and not out.is_dir():
        raise QuantizeError(f"{out} exists and is not a directory: a checkpoint is a folder, pass another OUT")
    if out.exists() and not overwrite:
        raise QuantizeError(f"{out} already exists: pass --overwrite to replace it")
    if out.exists():
        _check_replaceable(out)
        if os.path.ismount(out):  # found only at the end, after the whole run, by a failing rename
            raise QuantizeError(f"{out} is a mount point: the checkpoint is written beside it and renamed into "
                                "place, which a mount point cannot take; pass a folder inside it")
    if not out.parent.is_dir():
        raise QuantizeError(f"the parent folder of {out} does not exist")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise QuantizeError(f"cannot write in {out.parent} (permission denied)")


def leftover_temp_dirs(out) -> list[Path]:
    """The temp folders of `out` that a killed run left beside it (SIGKILL, the OOM killer: nothing could remove
    them), or that a run still going is writing."""
    out = Path(out).resolve()
    return sorted(p for pattern in (f".{out.name}.tmp-*", f".{out.name}.old-*") for p in out.parent.glob(pattern)
                  if p.is_dir())


def _check_replaceable(out: Path) -> None:
    """--overwrite replaces only an empty directory or an eightbit checkpoint: config.json with
    eightbit's quantization_config, and nothing but checkpoint files."""
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return
    others = [n for n in names if not (n in CHECKPOINT_FILES or SHARD_NAME.fullmatch(n)) or (out / n).is_dir()]
    if others:
        raise QuantizeError(f"refusing to replace {out}: it holds {', '.join(others[:5])}, which no eightbit "
                            "checkpoint has; --overwrite replaces only an empty folder or an earlier output")
    try:
        qc = json.loads((out / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        qc = None
    if not (isinstance(qc, dict) and EIGHTBIT_KEY in qc):
        raise QuantizeError(f"refusing to replace {out}: it is not a checkpoint eightbit quantize wrote "
                            "(no eightbit quantization_config in config.json)")


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C, so the temp dir is removed


@contextmanager
def _sigterm_unwinds():
    """While the block runs, SIGTERM (and SIGHUP: the terminal closed) raise SystemExit(128 + signal) instead of
    killing the process outright.

    Only for a signal with its default action (a handler of the caller's, or SIG_IGN, is left
    alone) and in the main thread (the only one that may set handlers)."""
    main = threading.current_thread() is threading.main_thread()
    signals = [s for s in (signal.SIGTERM, signal.SIGHUP) if main and signal.getsignal(s) == signal.SIG_DFL]
    previous = {s: signal.signal(s, _raise_on_sigterm) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _apply_umask(folder: Path) -> None:
    """mkdtemp makes 0700 and safetensors 0600: give the folder and its files the umask's modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for p in folder.iterdir():
        if p.is_file():
            os.chmod(p, 0o666 & ~umask)


@contextmanager
def atomic_output_dir(out, overwrite: bool = False):
    out = Path(out).resolve()
    check_output_path(out, overwrite)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        raise QuantizeError(f"cannot create a folder in {out.parent}: {e}") from None
    try:
        with _sigterm_unwinds():
            yield tmp
        _apply_umask(tmp)
        flush_to_disk(tmp)  # before the rename: a power loss after it must not leave empty files at OUT
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        with _sigterm_unwinds():  # a SIGTERM held back during the swap then still lets _replace remove the old one
            _move_into_place(tmp, out, overwrite)
    except KeyboardInterrupt:
        if tmp.exists():  # not moved: out is as it was, and nothing is left behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        raise InterruptedAfterMove(out) from None


class InterruptedAfterMove(KeyboardInterrupt):
    """A Ctrl-C that took effect once the finished checkpoint was at out (held back during the swap, or landing just
    after the rename): out holds the new checkpoint, complete. `note` says so, for the command's message."""

    def __init__(self, out: Path):
        super().__init__(str(out))
        self.note = f"{out} holds the new checkpoint, complete (the interrupt came as it was moved there)"


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished tmp to out. `out` is checked again first: something may have appeared there while the
    model was converted, and it is not ours to delete; then the new checkpoint stays in tmp and the error says so."""
    try:
        check_output_path(out, overwrite)
    except QuantizeError as e:
        raise QuantizeError(f"{out} changed while the model was converted ({e}); the new checkpoint is in {tmp}"
                            ) from None
    try:
        if out.exists():
            _replace(out, tmp)
        else:
            os.rename(tmp, out)
    except OSError as e:
        raise QuantizeError(f"cannot move the new checkpoint to {out}: {e}; it is in {tmp}") from None


def _replace(out: Path, tmp: Path) -> None:
    """Move out aside, tmp to out, then delete the old one; if tmp cannot move, the old one goes back. Signals wait
    for the two renames: an interrupt between them would leave no checkpoint at out."""
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    swapped = False
    try:
        with signals_deferred():
            os.rename(out, old / out.name)
            try:
                os.rename(tmp, out)
                swapped = True
            except OSError:
                os.rename(old / out.name, out)  # put the old checkpoint back
                raise
    finally:
        if swapped or not (old / out.name).exists():  # never delete an old checkpoint that could not go back
            shutil.rmtree(old, ignore_errors=True)


class ShardWriter:
    def __init__(self, folder: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[str, list[str]]] = []  # (temp file name, tensor names)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.pending or any(name in names for _, names in self.shards):
            raise ValueError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self.pending[name] = tensor.detach().to("cpu", copy=True).contiguous()  # own its memory, on the CPU
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        file = f"shard-{len(self.shards):05d}.safetensors.part"
        try:
            save_file(self.pending, str(self.folder / file), metadata={"format": "pt"})
        except Exception as e:  # a full disk, a file-size limit: safetensors raises its own error type
            raise QuantizeError(f"cannot write the checkpoint's tensors in {self.folder}: {e}") from None
        self.shards.append((file, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Flush, give the shards their final names and write the index. Returns the file names."""
        self.flush()
        n = len(self.shards)
        if n == 1:
            os.rename(self.folder / self.shards[0][0], self.folder / "model.safetensors")
            return ["model.safetensors"]
        weight_map, files = {}, []
        for k, (tmp_name, names) in enumerate(self.shards):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.rename(self.folder / tmp_name, self.folder / final)
            files.append(final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return files
