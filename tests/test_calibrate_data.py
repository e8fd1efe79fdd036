"""Calibration text: sources, windows, and clear errors for bad data."""

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

from eightbit.calibrate import data
from eightbit.calibrate.data import CalibrationText, default_calibration_source, load_calibration_text, make_windows
from eightbit.quant.errors import QuantizeError
from eightbit.quant.testing import make_tiny_tokenizer, tiny_text

SHARED_VALID = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "wiki.valid.raw"


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture
def wikitext_valid():
    assert SHARED_VALID.is_file(), f"{SHARED_VALID} is missing: the tests need ../shared/data beside the checkout"
    return SHARED_VALID


def test_text_file_is_read_whole(tmp_path):
    f = tmp_path / "c.txt"
    text = tiny_text(50)
    f.write_text(text)
    ct = load_calibration_text(str(f))
    assert ct.text == text and ct.source == str(f.resolve()) and len(ct.sha256) == 64


@pytest.mark.parametrize("ending", ["\n", "\r\n", "\r"])
def test_a_text_file_reads_as_datasets_reads_it_without_datasets(tmp_path, monkeypatch, ending):
    """Read through `datasets` before, which needs a writable cache even for a local file; the text (and so its
    recorded sha256) is the same."""
    import datasets

    f = tmp_path / "c.txt"
    f.write_bytes(ending.join(["first line", "", "ünïcödé \u2028 line", "last"]).encode())
    reference = "".join(datasets.load_dataset("text", data_files=str(f), split="train", keep_linebreaks=True,
                                              cache_dir=str(tmp_path / "cache"))["text"])
    monkeypatch.setitem(sys.modules, "datasets", None)  # any import of it fails
    assert load_calibration_text(str(f)).text == reference


@pytest.mark.parametrize("content", ["", "\n\n   \n"])
def test_empty_calibration_file_is_an_error(tmp_path, content):
    f = tmp_path / "empty.txt"
    f.write_text(content)
    with pytest.raises(QuantizeError, match="empty|no text"):
        load_calibration_text(str(f))


def test_missing_calibration_file_is_an_error(tmp_path):
    with pytest.raises(QuantizeError, match="does not exist"):
        load_calibration_text(str(tmp_path / "nope.txt"))
    with pytest.raises(QuantizeError, match="is a folder: pass a text file in it"):
        load_calibration_text(str(tmp_path))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # it exists: "does not exist" was wrong (so was /dev/null's)
    with pytest.raises(QuantizeError, match="is not a regular file"):
        load_calibration_text(str(fifo))


def test_a_calibration_file_that_is_not_utf8_is_named_as_such(tmp_path):
    """datasets reports "An error occurred while generating the dataset", its UnicodeDecodeError hidden behind."""
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\u00e9 au lait\n".encode("latin-1") * 100)
    with pytest.raises(QuantizeError, match=r"latin1.txt is not UTF-8 text \(invalid continuation byte: b'\\xe9"):
        load_calibration_text(str(f))


def test_datasets_source_from_a_local_folder(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "validation.txt").write_text("first line\nsecond line\n")
    ct = load_calibration_text(f"hf:{folder}")
    assert ct.text == "first line\nsecond line\n"
    with pytest.raises(QuantizeError, match="cannot load calibration dataset"):
        load_calibration_text(f"hf:{folder}::test")
    with pytest.raises(QuantizeError, match="hf:NAME"):
        load_calibration_text("hf:")


def _with_bos(tokenizer):
    """The tiny tokenizer with a post-processor that puts <s> in front of text, as Llama's does."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("adds_bos", [False, True])
def test_windows_are_spread_and_start_with_bos(tokenizer, adds_bos):
    tok = _with_bos(tokenizer) if adds_bos else tokenizer
    assert (tok("a")["input_ids"][0] == tok.bos_token_id == 1) == adds_bos  # the case this run is about
    ct = CalibrationText(tiny_text(300), "mem", "0" * 64)
    ids = tok(ct.text, add_special_tokens=False)["input_ids"]
    assert 1 not in ids
    cs = make_windows(ct, tok, num_samples=5, seq_len=33)
    assert cs.input_ids.shape == (5, 33) and cs.input_ids.dtype == torch.long
    assert cs.text_tokens == len(ids)
    if adds_bos:  # BOS, then a body of seq_len - 1 text tokens
        assert (cs.input_ids[:, 0] == 1).all()
        body = cs.input_ids[:, 1:]
    else:
        body = cs.input_ids
    assert body.shape[1] == 33 - adds_bos
    assert body[0].tolist() == ids[: body.shape[1]]  # first window at the start
    assert body[-1].tolist() == ids[len(ids) - body.shape[1]:]  # last window at the end
    assert cs.summary() == {"source": "mem", "sha256": "0" * 64, "text_tokens": len(ids), "num_samples": 5,
                            "seq_len": 33, "tokens": 165}


def test_a_long_text_is_tokenized_in_pieces_with_the_same_tokens(tokenizer, monkeypatch):
    """One call for the whole text took ~150 bytes of memory per character (2 GB for WikiText-2's train split)."""
    text = tiny_text(400)
    lengths = []

    class Spy:
        bos_token_id = tokenizer.bos_token_id

        def __call__(self, piece, add_special_tokens=True):
            if not add_special_tokens:  # the text, not the probe for a BOS
                lengths.append(len(piece))
            return tokenizer(piece, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(data, "TOKENIZE_CHARS", 1000)
    cs = make_windows(CalibrationText(text, "mem", "0" * 64), Spy(), num_samples=3, seq_len=40)
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(lengths) > 10 and max(lengths) < 1000 + max(map(len, text.split("\n")))
    assert cs.text_tokens == len(whole) and cs.input_ids[-1].tolist() == whole[-40:]  # same tokens, to the end
    assert "".join(data.text_pieces(text, 1000)) == text


def test_short_text_gives_fewer_windows_or_an_error(tokenizer):
    ct = CalibrationText("just a few words here. " * 5, "mem", "0" * 64)
    n = len(tokenizer(ct.text, add_special_tokens=False)["input_ids"])
    cs = make_windows(ct, tokenizer, num_samples=100, seq_len=n // 2)
    assert 1 <= cs.num_samples <= 2
    with pytest.raises(QuantizeError, match="fewer than one window"):
        make_windows(ct, tokenizer, num_samples=1, seq_len=n + 10)


def test_default_source_env_var_then_shared_then_error(monkeypatch, tmp_path):
    monkeypatch.setenv(data.ENV_VAR, str(tmp_path / "x.txt"))
    assert default_calibration_source() == str(tmp_path / "x.txt")
    monkeypatch.delenv(data.ENV_VAR)
    monkeypatch.setattr(data, "WIKITEXT_VALID", Path("no") / "such" / "file.raw")
    with pytest.raises(QuantizeError, match="--calib-data"):
        default_calibration_source()


def test_default_is_wikitext2_validation_not_test(wikitext_valid, monkeypatch):
    monkeypatch.delenv(data.ENV_VAR, raising=False)
    src = default_calibration_source()
    assert os.path.samefile(src, wikitext_valid)
    assert "valid" in Path(src).name and "test" not in Path(src).name
