"""An on-disk copy of a GGUF checkpoint as transformers converts it, so that only the first open pays for it.

transformers reads GGUF files in Python: the embedded SmolLM2 (98 MB) takes ~30 s on 2 cores to become a model, a
config and a tokenizer, most of it parsing the file's metadata, once for each. The converted checkpoint (float32
safetensors, config, generation config, tokenizer files) is written once under the cache directory and opened from
then on as an HF checkpoint directory (`eightbit generate` on the embedded model: ~35 s the first time, ~10 s
after).

One entry per GGUF path and transformers version (what transformers makes of a GGUF changes between its versions),
replaced when the file's size, modification or status-change time or this format changes, or when one of its files
no longer has the size it was written with. Two environments with different transformers versions that share the
cache each keep their entry (each used to replace the other's, ~30 s a time); of the entries that other versions made
from the same file, only the one written last stays (KEEP_OTHER_VERSIONS), so upgrades do not pile them up. An entry is written to a
temporary directory, flushed to disk and renamed into place, so a crash, Ctrl-C or power loss never leaves a
half-written one. Processes opening the same GGUF at once convert it once: the others wait on a lock file and then
read the first one's entry; where locks do not work, a process that finds a valid entry in place when its own
conversion ends keeps that one, so a reader's files are never pulled from under it. Where the cache cannot be
written (a read-only home, a full disk) the checkpoint is used from memory, with a warning.

EIGHTBIT_CACHE: the cache directory (default $XDG_CACHE_HOME/eightbit, else ~/.cache/eightbit); "off" turns it off.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

FORMAT = 2  # bump when what an entry holds changes: older entries are then converted again
SOURCE_FILE = "source.json"  # written last: what the entry was made from
ABANDONED_AFTER_S = 3600
KEEP_OTHER_VERSIONS = 1  # entries of the same GGUF file made by other transformers versions


def cache_root() -> Path | None:
    value = os.environ.get("EIGHTBIT_CACHE")
    if value is not None:
        return None if value.strip().lower() in ("", "off", "0", "none") else Path(value)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "eightbit"


def entry_dir(gguf: Path) -> Path | None:
    """Where the converted copy of this GGUF file lives (None: the cache is off)."""
    root = cache_root()
    if root is None:
        return None
    import transformers

    key = f"{gguf.resolve()}\0{transformers.__version__}\0{FORMAT}"
    return root / "gguf" / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _source(gguf: Path) -> dict:
    import transformers

    stat = gguf.stat()  # ctime too: a copy that keeps size and mtime (cp -p, rsync -a, tar) still changes it
    return {"gguf": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "ctime_ns": stat.st_ctime_ns, "transformers": transformers.__version__, "format": FORMAT}


def lookup(gguf: Path) -> Path | None:
    """The entry converted from this very file, whole (every file of the size it was written with), or None."""
    entry = entry_dir(gguf)
    try:
        if entry is None:
            return None
        recorded = json.loads((entry / SOURCE_FILE).read_text())
        files = recorded.pop("files")
        if recorded == _source(gguf) and all((entry / name).stat().st_size == size for name, size in files.items()):
            return entry
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # missing, damaged or of another format
        pass
    return None


@contextlib.contextmanager
def converting(gguf: Path):
    """Held while this GGUF is converted and stored: a second process opening it meanwhile waits here, then finds
    the first one's entry (lookup) instead of converting it again. Does nothing where the cache is off or the lock
    file cannot be made."""
    entry = entry_dir(gguf)
    if entry is None:  # the cache is off
        yield
        return
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock = open(entry.parent / f"{entry.name}.lock", "a")
    except OSError:  # the cache cannot be written
        yield
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process converting {gguf.name} ...", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: the store below is safe without one
            pass
        yield


def store(gguf: Path, write) -> Path | None:
    """Make the entry of this GGUF file: write(directory) fills a temporary directory, which then replaces any
    stale entry. Returns the entry, or None (with a warning) where it could not be written."""
    entry = entry_dir(gguf)
    if entry is None:
        return None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(entry)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    except OSError as e:
        return _not_stored(gguf, entry, e)
    try:
        write(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / SOURCE_FILE).write_text(json.dumps({**_source(gguf), "files": files}))
        flush_to_disk(tmp)
    except Exception as e:  # the copy only saves time: whatever stops it must not stop the open
        shutil.rmtree(tmp, ignore_errors=True)
        return _not_stored(gguf, entry, e)
    except BaseException:  # Ctrl-C: nothing left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if lookup(gguf) is not None:  # another process converted it meanwhile: its entry may be in use, keep it
        shutil.rmtree(tmp, ignore_errors=True)
        return entry
    try:
        _replace(entry, tmp)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if lookup(gguf) is not None:  # another process put its copy in place between the two steps
            return entry
        return _not_stored(gguf, entry, e)
    _prune_other_versions(gguf, entry)
    return entry


def _prune_other_versions(gguf: Path, entry: Path):
    """Remove the entries of this GGUF file that other transformers versions made, but the KEEP_OTHER_VERSIONS
    written last (renamed aside first, as _replace does, so that a process reading one keeps its files)."""
    others = []
    for sibling in entry.parent.glob(f"{gguf.stem}-*"):
        try:
            source = sibling / SOURCE_FILE
            if sibling != entry and sibling.is_dir() and json.loads(source.read_text())["gguf"] == str(gguf.resolve()):
                others.append((source.stat().st_mtime_ns, sibling))
        except (OSError, ValueError, KeyError, TypeError):  # not an entry of this file, or being replaced
            continue
    for _, old in sorted(others, reverse=True)[KEEP_OTHER_VERSIONS:]:
        try:
            aside = Path(tempfile.mkdtemp(prefix=f".{old.name}.old.", dir=entry.parent))
            os.rename(old, aside / "entry")
            shutil.rmtree(aside, ignore_errors=True)
            (entry.parent / f"{old.name}.lock").unlink(missing_ok=True)
        except OSError:
            pass


def _replace(entry: Path, tmp: Path):
    """Move tmp to entry. A stale or damaged entry is first renamed aside and removed only afterwards, so the
    files of a process still reading it stay whole."""
    old = None
    if entry.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{entry.name}.old.", dir=entry.parent))
        os.rename(entry, old / "entry")
    os.rename(tmp, entry)
    _flush_directory(entry.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def flush_to_disk(directory: Path):
    """Every file of directory on disk (a power loss after the rename must not leave empty files behind it)."""
    for path in directory.iterdir():
        if not path.is_file():
            continue
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    _flush_directory(directory)


def _flush_directory(directory: Path):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_abandoned(entry):
    """Temporary directories of this entry that a killed process left (older than ABANDONED_AFTER_S: a younger one
    may be another process's write in progress)."""
    for tmp in entry.parent.glob(f".{entry.name}.*"):
        try:
            if time.time() - tmp.stat().st_mtime > ABANDONED_AFTER_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _not_stored(gguf, entry, error):
    warnings.warn(f"could not cache the converted {gguf.name} in {entry.parent} ({error}); it will be converted "
                  "again next time (EIGHTBIT_CACHE sets another directory, EIGHTBIT_CACHE=off skips the cache)",
                  stacklevel=3)
    return None
