"""Opening checkpoints: clear errors for everything eightbit cannot or will not read."""

import json

import pytest
import torch
from safetensors.torch import save_file

from eightbit import LLM
from eightbit.engine.weights import CheckpointError, open_checkpoint


def write_config(folder, **config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))


def test_unknown_path():
    with pytest.raises(CheckpointError, match="no such model path"):
        open_checkpoint("/nonexistent/model")


def test_missing_config(tmp_path):
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no config.json"):
        open_checkpoint(tmp_path)


def test_pickled_weights_are_refused_not_unpickled(tmp_path):
    write_config(tmp_path, model_type="llama")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(CheckpointError, match="never unpickles"):
        open_checkpoint(tmp_path)


def test_truncated_safetensors(tmp_path):
    write_config(tmp_path, model_type="llama")
    save_file({"w": torch.arange(1000, dtype=torch.float32)}, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        open_checkpoint(tmp_path)


def test_a_tensor_in_two_files_is_refused(tmp_path):
    """A stray copy beside the real file (model.bak.safetensors) was merged in, the last file's tensor winning."""
    write_config(tmp_path, model_type="llama")
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    save_file({"w": torch.ones(2)}, tmp_path / "model.bak.safetensors")
    with pytest.raises(CheckpointError, match="tensor 'w' is in both model.bak.safetensors and model.safetensors"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("index, message", [
    ('{"metadata": {}}', r"KeyError: 'weight_map'"),
    ('{"weight_map": ', "JSONDecodeError: Expecting value"),
    ('{"weight_map": ["model.safetensors"]}', "weight_map is not a map of tensor names to file names"),
])
def test_a_broken_shard_index_is_named(tmp_path, index, message):
    write_config(tmp_path, model_type="llama")
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=rf"model.safetensors.index.json is not a valid shard index \(.*{message}"):
        open_checkpoint(tmp_path)


def test_garbage_safetensors(tmp_path):
    write_config(tmp_path, model_type="llama")
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a valid safetensors"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("header, message", [
    (b"[1, 2]", "its header is not a JSON object"),
    (b'{"w": {"dtype": "F32", "shape": [2]}}', "a tensor without data_offsets: KeyError"),
    (b'{"w": 7}', "a tensor without data_offsets: TypeError"),
])
def test_a_safetensors_header_of_the_wrong_form(tmp_path, header, message):
    """Such headers stopped the open with a bare TypeError or KeyError."""
    write_config(tmp_path, model_type="llama")
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match=f"model.safetensors is not a valid safetensors file \\({message}"):
        open_checkpoint(tmp_path)


def test_a_checkpoint_without_tokenizer_files_is_refused_before_its_weights_are_read(tmp_path, monkeypatch):
    """transformers said "... You need to have sentencepiece or tiktoken installed", after every weight was read."""
    from eightbit.engine.weights import Checkpoint
    from eightbit.quant.testing import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path)
    for tokenizer_file in tmp_path.glob("*token*"):
        tokenizer_file.unlink()
    reads = []
    real_get = Checkpoint.get_tensor
    monkeypatch.setattr(Checkpoint, "get_tensor", lambda self, name: reads.append(name) or real_get(self, name))
    with pytest.raises(CheckpointError, match=f"{tmp_path} has no tokenizer files \\(tokenizer.json, "):
        LLM(str(tmp_path), dtype="float32", device="cpu")
    assert reads == []


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        LLM(str(tmp_path), dtype="float32", device="cpu")


def test_a_non_gguf_file_is_refused(tmp_path):
    f = tmp_path / "weights.pt"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a .gguf"):
        open_checkpoint(f)


def test_eos_ids_join_the_generation_config_s_and_the_config_s():
    from types import SimpleNamespace

    from eightbit.engine.weights import Checkpoint

    def ids(gen, cfg):
        return Checkpoint(None, SimpleNamespace(eos_token_id=cfg), None if gen is False else
                          SimpleNamespace(eos_token_id=gen), None, []).eos_token_ids

    assert ids([128001, 128009], 128001) == [128001, 128009]  # Llama 3: several in generation_config.json
    assert ids(None, 2) == [2]  # a generation_config.json without eos_token_id: config.json's
    assert ids(False, [2, 7]) == [2, 7]  # no generation_config.json at all
    assert ids(5, 2) == [2, 5]


def test_a_safetensors_file_longer_than_its_header_says_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.arange(10, dtype=torch.float32)}, tmp_path / "model.safetensors")
    with open(tmp_path / "model.safetensors", "ab") as f:
        f.write(b"\0" * 64)  # a concatenation, or two files written over each other
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        open_checkpoint(tmp_path)


def test_a_shard_index_naming_a_missing_file_is_named(tmp_path):
    """A half-copied sharded checkpoint: the index names a shard that is not there (without the check, a bare
    FileNotFoundError from deep inside the header check)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"a": torch.zeros(2)}, tmp_path / "model-00001-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"names missing shard\(s\): model-00002-of-00002.safetensors"):
        open_checkpoint(tmp_path)
