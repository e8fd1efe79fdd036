"""Writing a checkpoint directory atomically, tensors streamed into ~2 GB safetensors shards.

`atomic_output_dir(out, overwrite)` yields a fresh temp dir beside `out`; only when the
block finishes is it renamed to `out` (replacing an old `out` if overwrite). Any exception,
KeyboardInterrupt included, removes the temp dir, so a failed run leaves nothing behind.
`ShardWriter` writes tensors in the order given, flushing a shard when it would pass the size
limit, and names them as transformers does (model.safetensors, or model-0000k-of-0000n with
model.safetensors.index.json).
"""

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from eightbit.quant.errors import QuantizeError

DEFAULT_SHARD_BYTES = 2 * 1024**3


def check_output_path(out: Path, overwrite: bool) -> None:
    out = Path(out)
    if out.exists() and not overwrite:
        raise QuantizeError(f"{out} already exists: pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise QuantizeError(f"{out} exists and is not a directory")
    if not out.parent.is_dir():
        raise QuantizeError(f"the parent folder of {out} does not exist")


@contextmanager
def atomic_output_dir(out, overwrite: bool = False):
    out = Path(out)
    check_output_path(out, overwrite)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / out.name)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
        save_file(self.pending, str(self.folder / file), metadata={"format": "pt"})
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
