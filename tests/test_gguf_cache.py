"""The on-disk copy of a converted GGUF (engine/gguf_cache.py): the same model, tokenizer and generation settings
as transformers' own reading of the file; replaced when stale or damaged; never left half-written."""

import gc
import json
import os
import struct
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import save_file

from eightbit.engine import gguf_cache, weights
from eightbit.engine.weights import Checkpoint, CheckpointError, open_checkpoint
from eightbit.quant.convert import source_model

TEXTS = ["The capital of France is", "  spaces,\ttabs\nand ünïcödé 🙂", "<|im_start|>user\nhi<|im_end|>"]


def test_the_converted_copy_is_what_transformers_reads_from_the_gguf(hf_model, tokenizer, smollm_path):
    open_checkpoint()  # converted here, or earlier in this run: either way the copy exists afterwards
    ckpt = open_checkpoint()
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
    """What the cache holds beside the entry and its lock file: temporary directories of unfinished writes."""
    entry = gguf_cache.entry_dir(gguf)
    if not entry.parent.exists():
        return []
    return [p.name for p in entry.parent.iterdir() if p not in (entry, entry.parent / f"{entry.name}.lock")]


def test_an_entry_is_used_until_its_file_changes(gguf):
    assert gguf_cache.lookup(gguf) is None
    entry = gguf_cache.store(gguf, write_marker("first"))
    assert gguf_cache.lookup(gguf) == entry and (entry / "marker").read_text() == "first"
    gguf.write_bytes(b"GGUF two, longer")  # another file at the same path
    assert gguf_cache.lookup(gguf) is None
    assert gguf_cache.store(gguf, write_marker("two")) == entry and gguf_cache.lookup(gguf) == entry
    stat = gguf.stat()
    gguf.write_bytes(b"GGUF 2, as long!")  # copied over with its size and mtime kept (cp -p, rsync -a)
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert gguf.stat().st_size == stat.st_size and gguf.stat().st_mtime_ns == stat.st_mtime_ns
    assert gguf_cache.lookup(gguf) is None
    assert gguf_cache.store(gguf, write_marker("second")) == entry
    assert gguf_cache.lookup(gguf) == entry and (entry / "marker").read_text() == "second"
    assert leftovers(gguf) == []


def test_each_transformers_version_keeps_its_entry_and_old_ones_do_not_pile_up(gguf, monkeypatch):
    """What transformers makes of a GGUF changes between its versions. Two environments sharing a cache each keep
    their entry (each used to replace the other's); of another version's entries of the same file only the one
    written last stays. Another file's entry is left alone."""
    import transformers

    other = gguf.parent / "model-q8.gguf"  # its entries share the "model-" prefix
    other.write_bytes(b"GGUF other")
    entries = {}
    for version in ("4.0", "5.0", "4.0", "6.0"):
        monkeypatch.setattr(transformers, "__version__", version)
        if gguf_cache.lookup(gguf) is None:
            entries[version] = gguf_cache.store(gguf, write_marker(version))
            gguf_cache.store(other, write_marker("other " + version))
        time.sleep(0.01)  # distinct write times
    assert len(set(entries.values())) == 3  # 4.0's entry was found again, not rewritten
    for version, present in (("4.0", False), ("5.0", True), ("6.0", True)):
        monkeypatch.setattr(transformers, "__version__", version)
        assert (gguf_cache.lookup(gguf) == entries[version]) is present and entries[version].exists() is present
        if present:
            assert (entries[version] / "marker").read_text() == version
        assert gguf_cache.lookup(other) is not None or version == "4.0"  # its own 4.0 entry went the same way
    assert sorted(p.name for p in gguf_cache.entry_dir(gguf).parent.iterdir() if p.name.startswith(".")) == []


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


@pytest.fixture
def stand_in(monkeypatch):
    """A small stand-in for transformers' conversion (it counts its calls), so that _open_gguf's own flow runs."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)
    state = {"model.embed_tokens.weight": torch.randn(64, 16), "model.norm.weight": torch.rand(16)}
    conversions = []

    def convert(path):
        conversions.append(path)
        time.sleep(0.2)  # long enough for a second opener to arrive while it runs
        copy = {name: t.clone() for name, t in state.items()}
        return Checkpoint(path, config, None, copy.__getitem__, list(copy)), copy

    def write(checkpoint, state, directory):  # what _write_converted writes, with a JSON file for the tokenizer's
        checkpoint.config.save_pretrained(directory)
        save_file(state, directory / "model.safetensors")
        (directory / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))

    monkeypatch.setattr(weights, "_convert_gguf", convert)
    monkeypatch.setattr(weights, "_write_converted", write)
    return conversions, state


def read_all(ckpt):
    return {name: ckpt.get_tensor(name) for name in ckpt.tensor_names()}


def same(tensors, state):
    return tensors.keys() == state.keys() and all(torch.equal(tensors[k], state[k]) for k in state)


@pytest.mark.parametrize("damage", ["truncated weights", "empty JSON file"])
def test_open_converts_once_and_again_only_when_the_copy_is_damaged(gguf, stand_in, damage):
    conversions, state = stand_in
    for _ in range(2):
        ckpt = open_checkpoint(gguf)
        assert len(conversions) == 1 and ckpt.path == gguf_cache.entry_dir(gguf) and same(read_all(ckpt), state)
    entry = gguf_cache.entry_dir(gguf)
    if damage == "truncated weights":
        (entry / "model.safetensors").write_bytes((entry / "model.safetensors").read_bytes()[:-8])
    else:  # what a power loss can leave of a file: the tokenizer's was opened only after the weights, and failed
        (entry / "tokenizer.json").write_text("")
    ckpt = open_checkpoint(gguf)
    assert len(conversions) == 2 and same(read_all(ckpt), state)
    assert json.loads((entry / "tokenizer.json").read_text()) and leftovers(gguf) == []


def test_processes_opening_one_gguf_at_once_convert_it_once(gguf, stand_in):
    """Two openers at once (threads here: the lock file's locks exclude each other's opens as processes do)."""
    conversions, state = stand_in
    with ThreadPoolExecutor(2) as pool:
        opened = list(pool.map(lambda _: read_all(open_checkpoint(gguf)), range(2)))
    assert len(conversions) == 1 and all(same(tensors, state) for tensors in opened)


def test_a_reader_of_an_entry_keeps_its_files_when_another_process_stores_one(gguf, stand_in):
    conversions, state = stand_in
    reader = open_checkpoint(gguf)
    entry = gguf_cache.entry_dir(gguf)
    inode = entry.stat().st_ino
    # a second process whose conversion ran beside the first one's finds the first one's entry when it ends: kept
    assert gguf_cache.store(gguf, write_marker("late")) == entry and entry.stat().st_ino == inode
    assert not (entry / "marker").exists() and leftovers(gguf) == []
    gguf.write_bytes(b"GGUF two, longer")  # now stale: replaced by the next store, under the reader's open files
    assert gguf_cache.store(gguf, write_marker("new")) == entry and (entry / "marker").read_text() == "new"
    assert same(read_all(reader), state) and leftovers(gguf) == []


def test_without_a_cache_the_converted_model_goes_with_its_checkpoint(gguf, stand_in, monkeypatch):
    """It stayed in memory for the life of the process (a second float32 model beside the engine's)."""
    conversions, state = stand_in
    monkeypatch.setenv("EIGHTBIT_CACHE", "off")
    ckpt = open_checkpoint(gguf)
    assert ckpt.path == gguf and same(read_all(ckpt), state)
    held = weakref.ref(ckpt.get_tensor("model.norm.weight"))
    del ckpt
    gc.collect()
    assert held() is None
    assert same(read_all(open_checkpoint(gguf)), state) and len(conversions) == 2


def write_gguf_header(path, keys):
    """A GGUF v3 file's header by the format's spec: (key, type, value) triples; type 8 string, 4 uint32,
    9 an array given as (item type, values)."""
    def string(text):
        data = text.encode()
        return struct.pack("<Q", len(data)) + data

    def value(kind, v):
        if kind == 8:
            return string(v)
        if kind == 4:
            return struct.pack("<I", v)
        item, values = v
        return struct.pack("<IQ", item, len(values)) + b"".join(value(item, x) for x in values)

    body = b"".join(string(k) + struct.pack("<I", kind) + value(kind, v) for k, kind, v in keys)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(keys)) + body)


@pytest.mark.parametrize("arch", ["phi3", "gemma2"])
def test_a_gguf_of_another_architecture_is_refused_before_it_is_converted(gguf, stand_in, arch):
    conversions, _ = stand_in
    write_gguf_header(gguf, [("tokenizer.ggml.tokens", 9, (8, ["a", "bc", "<s>"])), ("tokenizer.ggml.scores", 9,
                      (4, [1, 2, 3])), ("general.alignment", 4, 32), ("general.architecture", 8, arch)])
    with pytest.raises(CheckpointError, match=f"model.gguf is a GGUF of architecture '{arch}'"):
        open_checkpoint(gguf)
    assert conversions == [] and leftovers(gguf) == []


def test_the_architecture_is_read_as_the_gguf_package_reads_it(tmp_path, smollm_path):
    from gguf import GGUFReader, GGUFWriter

    path = tmp_path / "small.gguf"
    writer = GGUFWriter(path, "qwen2")
    writer.add_token_list(["a", "bc"])
    writer.add_context_length(64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert weights._gguf_architecture(path) == GGUFReader(path).fields["general.architecture"].contents() == "qwen2"
    assert weights._gguf_architecture(smollm_path) == "llama"
    path.write_bytes(b"GGUF\x03\x00")  # cut short: transformers says what is wrong
    assert weights._gguf_architecture(path) is None


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


@pytest.mark.parametrize("value", ["off", "OFF", " off ", "0", "none", ""])
def test_every_spelling_of_off_turns_the_cache_off(value, monkeypatch):
    monkeypatch.setenv("EIGHTBIT_CACHE", value)
    assert gguf_cache.cache_root() is None


def test_a_pruned_entry_takes_its_lock_file_with_it(tmp_path, monkeypatch):
    import transformers

    monkeypatch.setenv("EIGHTBIT_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF one")
    entries = []
    for version in ("4.0", "5.0", "6.0"):
        monkeypatch.setattr(transformers, "__version__", version)
        with gguf_cache.converting(gguf):  # as weights._open_gguf does: the lock file is made here
            entries.append(gguf_cache.store(gguf, lambda d: (d / "marker").write_text("x")))
        time.sleep(0.01)
    assert not entries[0].exists() and entries[1].exists() and entries[2].exists()
    locks = sorted(p.name for p in entries[0].parent.glob("*.lock"))
    assert locks == sorted(f"{e.name}.lock" for e in entries[1:])
