"""The on-disk copy of a converted GGUF (engine/gguf_cache.py): the same model, tokenizer and generation settings
as transformers' own reading of the file; replaced when stale or damaged; never left half-written."""

import os
import time
import warnings

import pytest
import torch
from safetensors.torch import save_file

from eightbit.engine import gguf_cache, weights
from eightbit.engine.weights import Checkpoint, open_checkpoint
from eightbit.quant.convert import source_model

TEXTS = ["The capital of France is", "  spaces,\ttabs\nand ünïcödé 🙂", "<|im_start|>user\nhi<|im_end|>"]


def test_the_converted_copy_is_what_transformers_reads_from_the_gguf(hf_model, tokenizer, smollm_path):
    weights._open_gguf.cache_clear()
    open_checkpoint()  # converted here, or earlier in this run: either way the copy exists afterwards
    weights._open_gguf.cache_clear()
    ckpt = open_checkpoint()
    weights._open_gguf.cache_clear()  # later tests open it again, from the copy
    assert ckpt.path == gguf_cache.entry_dir(smollm_path) and gguf_cache.lookup(smollm_path) == ckpt.path
    # what a quantized checkpoint records as its source is the GGUF, wherever it was read from (eval refused a
    # SmoothQuant checkpoint made from the cached copy once the cache was off)
    assert ckpt.source == smollm_path and source_model(ckpt) == str(smollm_path.resolve())

    reference = hf_model.state_dict()
    assert set(ckpt.tensor_names()) == set(reference) - {"lm_head.weight"}  # tied: the loader ties it
    assert hf_model.config.tie_word_embeddings
    for name in ckpt.tensor_names():
        assert torch.equal(ckpt.get_tensor(name), reference[name]), name
    differ = {"quantization_config", "_name_or_path"}  # GGUF's (the weights are dequantized); where it was read
    assert ({k: v for k, v in ckpt.config.to_dict().items() if k not in differ}
            == {k: v for k, v in hf_model.config.to_dict().items() if k not in differ})
    assert ckpt.eos_token_ids == Checkpoint(smollm_path, hf_model.config, hf_model.generation_config, None,
                                            []).eos_token_ids

    copy = ckpt.load_tokenizer()
    for text in TEXTS:
        assert copy(text)["input_ids"] == tokenizer(text)["input_ids"], text
    ids = tokenizer(TEXTS[1])["input_ids"]
    assert copy.decode(ids) == tokenizer.decode(ids)
    chat = [{"role": "user", "content": "Write a haiku about int8."}]
    assert (copy.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A stand-in GGUF file and a cache directory of the test's own."""
    monkeypatch.setenv("EIGHTBIT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF one")
    return path


def write_marker(text):
    return lambda directory: (directory / "marker").write_text(text)


def leftovers(gguf):
    """What the cache holds beside the entry: temporary directories of unfinished writes."""
    entry = gguf_cache.entry_dir(gguf)
    return [p.name for p in entry.parent.iterdir() if p != entry] if entry.parent.exists() else []


def test_an_entry_is_used_until_its_file_changes(gguf):
    assert gguf_cache.lookup(gguf) is None
    entry = gguf_cache.store(gguf, write_marker("first"))
    assert gguf_cache.lookup(gguf) == entry and (entry / "marker").read_text() == "first"
    gguf.write_bytes(b"GGUF two, longer")  # another file at the same path
    assert gguf_cache.lookup(gguf) is None
    assert gguf_cache.store(gguf, write_marker("second")) == entry
    assert gguf_cache.lookup(gguf) == entry and (entry / "marker").read_text() == "second"
    assert leftovers(gguf) == []


def test_an_interrupted_or_failed_write_leaves_the_old_entry_and_nothing_else(gguf):
    entry = gguf_cache.store(gguf, write_marker("kept"))

    def interrupted(directory):
        (directory / "marker").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gguf_cache.store(gguf, interrupted)
    assert (entry / "marker").read_text() == "kept" and leftovers(gguf) == []

    def disk_full(directory):
        raise OSError(28, "No space left on device")

    def refused(directory):
        raise RuntimeError("the tokenizer cannot be saved")

    for write, message in ((disk_full, "No space left"), (refused, "the tokenizer cannot be saved")):
        with pytest.warns(UserWarning, match=f"could not cache the converted model.gguf.*{message}"):
            assert gguf_cache.store(gguf, write) is None
        assert (entry / "marker").read_text() == "kept" and leftovers(gguf) == []


def test_a_cache_that_cannot_be_written_warns_and_one_that_is_off_is_not_touched(gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("EIGHTBIT_CACHE", str(blocker))
    with pytest.warns(UserWarning, match="could not cache"):
        assert gguf_cache.store(gguf, write_marker("x")) is None
    assert blocker.read_text() == "not a directory"

    monkeypatch.setenv("EIGHTBIT_CACHE", "off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gguf_cache.entry_dir(gguf) is None and gguf_cache.store(gguf, write_marker("x")) is None
    assert gguf_cache.lookup(gguf) is None


def test_open_converts_once_and_again_only_when_the_copy_is_damaged(gguf, monkeypatch):
    """_open_gguf's own flow, with a small stand-in for transformers' conversion."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)
    state = {"model.embed_tokens.weight": torch.randn(64, 16), "model.norm.weight": torch.rand(16)}
    conversions = []

    def convert(path):
        conversions.append(path)
        return Checkpoint(path, config, None, state.__getitem__, list(state)), state

    def write(checkpoint, state, directory):  # what _write_converted writes, less the tokenizer
        checkpoint.config.save_pretrained(directory)
        save_file(state, directory / "model.safetensors")

    monkeypatch.setattr(weights, "_convert_gguf", convert)
    monkeypatch.setattr(weights, "_write_converted", write)

    def opened():
        weights._open_gguf.cache_clear()
        try:
            ckpt = open_checkpoint(gguf)
            return ckpt, {name: ckpt.get_tensor(name) for name in ckpt.tensor_names()}
        finally:
            weights._open_gguf.cache_clear()

    for expected_conversions in (1, 1):
        ckpt, tensors = opened()
        assert len(conversions) == expected_conversions and ckpt.path == gguf_cache.entry_dir(gguf)
        assert tensors.keys() == state.keys() and all(torch.equal(tensors[k], state[k]) for k in state)
    model_file = gguf_cache.entry_dir(gguf) / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:-8])  # damaged on disk
    ckpt, tensors = opened()
    assert len(conversions) == 2 and all(torch.equal(tensors[k], state[k]) for k in state)
    assert leftovers(gguf) == []


def test_a_write_removes_what_a_killed_write_left_but_not_one_in_progress(gguf):
    entry = gguf_cache.entry_dir(gguf)
    abandoned, in_progress = entry.parent / f".{entry.name}.killed", entry.parent / f".{entry.name}.running"
    for tmp in (abandoned, in_progress):
        tmp.mkdir(parents=True)
        (tmp / "model.safetensors").write_bytes(b"partial")
    hours_ago = time.time() - 2 * gguf_cache.ABANDONED_AFTER_S
    os.utime(abandoned, (hours_ago, hours_ago))
    gguf_cache.store(gguf, write_marker("x"))
    assert sorted(leftovers(gguf)) == [in_progress.name]
