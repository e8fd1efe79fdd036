"""The argparse front of `eightbit quantize`."""

import argparse
import json
import os
import signal
from pathlib import Path

import pytest

from eightbit.quant import cli
from eightbit.quant.testing import make_tiny_checkpoint, make_tiny_tokenizer, tiny_text


def tiny_source(tmp_path, num_hidden_layers=1):
    """A tiny checkpoint to quantize and a calibration text for it: (its folder, the text's path)."""
    src = make_tiny_checkpoint(tmp_path / "src", tokenizer=make_tiny_tokenizer(), num_hidden_layers=num_hidden_layers)
    calib = tmp_path / "c.txt"
    calib.write_text(tiny_text(50))
    return src, calib


def parse(argv):
    parser = argparse.ArgumentParser(prog="eightbit")
    cli.add_quantize_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["quantize", *argv])


def test_defaults():
    a = parse(["src", "out"])
    assert (a.src, a.out, a.calib_data, a.alpha, a.kv_group_size, a.overwrite) == ("src", "out", None, "auto", 32,
                                                                                    False)
    assert (a.num_samples, a.seq_len) == (cli.DEFAULT_NUM_SAMPLES, None)  # None: DEFAULT_SEQ_LEN or the context
    assert a.func is cli.run_quantize


def test_help_documents_the_calibration_default(capsys):
    with pytest.raises(SystemExit):
        parse(["--help"])
    text = capsys.readouterr().out
    assert "--calib-data" in text and "wiki.valid.raw" in text and "EIGHTBIT_CALIB_DATA" in text


def test_one_path_is_always_out_for_the_embedded_model(monkeypatch, tmp_path, capsys):
    seen = []
    monkeypatch.setattr(cli, "quantize", lambda src, out, **kw: seen.append((src, out, kw["overwrite"])) or {})
    monkeypatch.setattr(cli, "_report", lambda out, summary: None)
    assert cli.run_quantize(parse([str(tmp_path / "new")])) == 0
    assert seen == [(None, str(tmp_path / "new"), False)]
    assert cli.run_quantize(parse([str(tmp_path)])) == 2  # exists: still OUT, and --overwrite is needed
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err and "give SRC and OUT" in err
    assert err.startswith("eightbit quantize: error: ")  # as every other command says it
    assert len(seen) == 1
    assert cli.run_quantize(parse([str(tmp_path), "--overwrite"])) == 0  # a rerun of `eightbit quantize OUT`
    assert seen[-1] == (None, str(tmp_path), True)
    assert cli.run_quantize(parse([])) == 2 and "missing OUT" in capsys.readouterr().err
    for name in ("Llama-3.2-1B.gguf", "model.safetensors"):  # a source not downloaded yet became the OUT folder
        assert cli.run_quantize(parse([str(tmp_path / name)])) == 2
        assert f"{tmp_path / name} is named like a model file, but one path is OUT" in capsys.readouterr().err
    assert len(seen) == 2 and not (tmp_path / "Llama-3.2-1B.gguf").exists()


def test_one_path_says_the_embedded_model_is_quantized(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "quantize", lambda src, out, **kw: {})
    monkeypatch.setattr(cli, "_report", lambda out, summary: None)
    assert cli.run_quantize(parse([str(tmp_path / "new")])) == 0
    assert f"no SRC given: quantizing the embedded SmolLM2-135M-Instruct into {tmp_path / 'new'}" in \
        capsys.readouterr().out


def test_no_progress_silences_transformers_bars_too(monkeypatch, tmp_path):
    """transformers' GGUF conversion draws a bar of its own, which --no-progress left on."""
    from transformers.utils import logging as hf_logging

    seen = []
    monkeypatch.setattr(cli, "quantize", lambda *a, **kw: seen.append(hf_logging.is_progress_bar_enabled()) or {})
    monkeypatch.setattr(cli, "_report", lambda out, summary: None)
    try:
        assert cli.run_quantize(parse([str(tmp_path / "q"), "--no-progress"])) == 0
        assert seen == [False]
    finally:
        hf_logging.enable_progress_bar()


@pytest.fixture
def no_model_loading(monkeypatch):
    from eightbit.engine import weights

    def fail(*a, **k):
        raise AssertionError("the model was opened before the options were checked")

    monkeypatch.setattr(weights, "open_checkpoint", fail)


@pytest.mark.parametrize("option, value, message", [
    ("--num-samples", "0", "num_samples >= 1"),
    ("--seq-len", "1", "seq_len >= 2"),
    ("--kv-group-size", "7", "group size 7 does not fit head_dim 32"),
    ("--kv-group-size", "0", "positive integer"),
    ("--seq-len", "100000", "longer than the model's context of"),
])
def test_sizes_are_checked_before_the_model_loads(tmp_path, capsys, no_model_loading, option, value, message):
    src = make_tiny_checkpoint(tmp_path / "src", tokenizer=make_tiny_tokenizer(), num_hidden_layers=1)
    out = tmp_path / "q"
    assert cli.run_quantize(parse([str(src), str(out), option, value, "--calib-data", str(tmp_path / "none")])) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_the_default_window_fits_the_models_context(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "src", tokenizer=make_tiny_tokenizer(), num_hidden_layers=1)  # 256
    assert cli._check_sizes(src, 4, None, 32) == 256 < cli.DEFAULT_SEQ_LEN
    assert cli._check_sizes(None, 4, None, 32) == cli.DEFAULT_SEQ_LEN  # the embedded SmolLM2: 8,192
    assert cli._check_sizes(src, 4, 100, 32) == 100


def test_group_size_is_checked_against_a_gguf_head_dim_before_its_weights_load(tmp_path, capsys, no_model_loading):
    assert cli.run_quantize(parse([str(tmp_path / "q"), "--kv-group-size", "7"])) == 2  # the embedded GGUF
    assert "group size 7 does not fit head_dim 64" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_run_end_to_end_and_errors(tmp_path, capsys):
    src, calib = tiny_source(tmp_path)
    argv = [str(src), str(tmp_path / "q"), "--calib-data", str(calib), "--num-samples", "2", "--seq-len", "32",
            "--alpha", "0.5", "--kv-group-size", "16", "--no-progress"]
    assert cli.run_quantize(parse(argv)) == 0
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    ours = cfg["quantization_config"]["eightbit"]
    assert ours["kv_cache"]["group_size"] == 16 and ours["calibration"]["alpha"] == 0.5
    assert "wrote" in capsys.readouterr().out
    assert cli.run_quantize(parse(argv)) == 2  # exists
    assert "--overwrite" in capsys.readouterr().err
    assert cli.run_quantize(parse(argv + ["--overwrite", "--kv-group-size", "24"])) == 2
    assert "group size 24" in capsys.readouterr().err
    more = argv[:1] + [str(tmp_path / "q2")] + argv[2:] + ["--num-samples", "1000"]  # the last one counts
    assert cli.run_quantize(parse(more)) == 0
    cfg = json.loads((tmp_path / "q2" / "config.json").read_text())
    taken = cfg["quantization_config"]["eightbit"]["calibration"]["data"]["num_samples"]
    assert 2 < taken < 1000 and f"holds {taken} windows of 32 tokens, fewer than the 1000" in capsys.readouterr().err


def test_device_option_and_bad_devices(tmp_path, monkeypatch):
    assert parse(["src", "out"]).device == "auto"
    assert parse(["src", "out", "--device", "cpu"]).device == "cpu"
    import torch

    expect = "cuda" if torch.cuda.is_available() else "cpu"
    assert cli._resolve_device("auto").type == expect
    assert cli._resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(cli.QuantizeError, match="--device: device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu0'"):
        cli._resolve_device("gpu0")
    for device in ("mps", "meta"):  # calibration failed on them with a traceback, after the text and tokenizer loaded
        with pytest.raises(cli.QuantizeError, match=f"--device: device must be 'cpu', 'cuda' or 'cuda:N', got '{device}'"):
            cli._resolve_device(device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(cli.QuantizeError, match="no CUDA GPU"):
        cli.quantize(None, tmp_path / "out", device="cuda")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option, value, message", [
    ("sample_tokens", 0, "sample_tokens must be an int >= 1, got 0"),
    ("batch_size", "8", "batch_size must be an int >= 1, got '8'"),
    ("max_shard_bytes", -1, "max_shard_bytes must be an int >= 1"),
    ("alpha_grid", (), "alpha_grid must be a non-empty sequence of numbers in [0, 1]"),
    ("alpha_grid", (0.5, 2.0), "alpha_grid must be a non-empty sequence of numbers in [0, 1]"),
])
def test_the_python_apis_conversion_options_are_checked_before_the_model_loads(tmp_path, no_model_loading, option,
                                                                                value, message):
    """quantize(**convert_options) took sample_tokens=0 to a KeyError deep in the calibration."""
    src = make_tiny_checkpoint(tmp_path / "src", tokenizer=make_tiny_tokenizer(), num_hidden_layers=1)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        cli.quantize(src, tmp_path / "q", calib_data=str(tmp_path / "none"), **{option: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'sampel_tokens'"):
        cli.quantize(src, tmp_path / "q", calib_data=str(tmp_path / "none"), sampel_tokens=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_file_at_out_is_named_as_such_and_leftovers_of_a_killed_run_are_pointed_out(tmp_path, capsys):
    src, calib = tiny_source(tmp_path)
    (tmp_path / "afile").write_text("mine")
    for extra in ([], ["--overwrite"]):  # no advice to pass --overwrite, which would refuse it anyway
        assert cli.run_quantize(parse([str(src), str(tmp_path / "afile"), "--calib-data", str(calib)] + extra)) == 2
        err = capsys.readouterr().err
        assert "exists and is not a directory" in err and "--overwrite" not in err
    assert (tmp_path / "afile").read_text() == "mine"
    killed = tmp_path / ".q.tmp-abc123"  # what a SIGKILLed run leaves: nothing could remove it
    killed.mkdir()
    argv = [str(src), str(tmp_path / "q"), "--calib-data", str(calib), "--num-samples", "2", "--seq-len", "32",
            "--no-progress"]
    assert cli.run_quantize(parse(argv)) == 0
    assert f"note: .q.tmp-abc123 in {tmp_path} were left by an earlier run" in capsys.readouterr().err
    assert killed.is_dir()  # pointed out, not deleted: it may be a run still going


def test_a_full_disk_while_writing_the_config_or_tokenizer_is_a_clear_error(tmp_path, monkeypatch, capsys):
    """Only the shards' writes turned a full disk into a message; the small files after them raised OSError."""
    import errno

    from transformers import PreTrainedTokenizerBase

    src, calib = tiny_source(tmp_path)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full)
    argv = [str(src), str(tmp_path / "q"), "--calib-data", str(calib), "--num-samples", "2", "--seq-len", "32",
            "--no-progress"]
    assert cli.run_quantize(parse(argv)) == 2
    assert "cannot write the checkpoint in" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "src"]  # the temp folder removed


def test_the_layer_bar_shows_a_layers_alphas_beside_its_own_count(tmp_path, capsys):
    """The alphas of the layer just quantized were drawn while the bar still counted the layers before it
    ("0/2 ... qkv=0.5" after the first layer, review_s58_doors)."""
    import re

    src, calib = tiny_source(tmp_path, num_hidden_layers=2)
    argv = [str(src), str(tmp_path / "q"), "--calib-data", str(calib), "--num-samples", "2", "--seq-len", "32",
            "--alpha", "0.5"]
    assert cli.run_quantize(parse(argv)) == 0
    draws = [d for d in re.split(r"[\r\n]", capsys.readouterr().err) if d.startswith("quantize layers")]
    assert draws and "2/2" in draws[-1] and "qkv=0.5" in draws[-1], draws
    assert not [d for d in draws if "0/2" in d and "qkv=" in d], draws


# --- review s62: mutation gaps of quant/cli.py --------------------------------------------------------------------


def test_the_python_api_needs_an_output_directory(tmp_path, no_model_loading):
    with pytest.raises(cli.QuantizeError, match="no output directory given"):
        cli.quantize(None, None)
    with pytest.raises(cli.QuantizeError, match="no output directory given"):
        cli.quantize(calib_data=str(tmp_path / "none"))  # out defaults to None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value, want", [
    ("auto", "auto"), (None, None), ("none", None), ("None", None), ("off", None), ("OFF", None),
    ("0", 0.0), (0, 0.0), ("1", 1.0), (1.0, 1.0), ("0.25", 0.25),
])
def test_alpha_words_and_the_ends_of_its_range(value, want):
    """'none' and 'off' (any case) mean no smoothing; 0 and 1 are alphas in [0, 1] like any other."""
    got = cli._parse_alpha(value)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("value", ["1.0001", "-1e-9", "nan", "inf", "auto!"])
def test_alphas_outside_0_1_are_refused(value):
    with pytest.raises(cli.QuantizeError, match="alpha must"):
        cli._parse_alpha(value)


def test_a_window_as_long_as_the_context_is_taken_and_one_token_more_is_refused(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "src", tokenizer=make_tiny_tokenizer(), num_hidden_layers=1)
    context = json.loads((src / "config.json").read_text())["max_position_embeddings"]
    assert cli._check_sizes(src, 4, context, 32) == context
    with pytest.raises(cli.QuantizeError, match=f"--seq-len {context + 1} is longer than the model's context of "
                                                f"{context} tokens"):
        cli._check_sizes(src, 4, context + 1, 32)


def test_an_odd_group_size_with_a_missing_source_says_the_source_is_missing(tmp_path, capsys):
    """Without a config to read head_dim from, the group size is checked once the source opens: the error is the
    source's, not a traceback from reading head_dim off no config."""
    calib = tmp_path / "c.txt"
    calib.write_text(tiny_text(20))
    argv = [str(tmp_path / "missing"), str(tmp_path / "q"), "--kv-group-size", "24", "--calib-data", str(calib)]
    assert cli.run_quantize(parse(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("eightbit quantize: error: ") and "no such model path" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]


@pytest.mark.parametrize("name", ["Llama.GGUF", "model.SafeTensors", "pytorch_model.bin", "consolidated.pt",
                                  "weights.pth", "WEIGHTS.PTH"])
def test_one_path_named_like_any_model_file_is_refused_as_out(tmp_path, capsys, monkeypatch, name):
    monkeypatch.setattr(cli, "quantize", lambda *a, **k: pytest.fail("quantize ran"))
    assert cli.run_quantize(parse([str(tmp_path / name)])) == 2
    assert f"{tmp_path / name} is named like a model file, but one path is OUT" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_device_option_reaches_the_run(tmp_path, capsys, no_model_loading):
    src = make_tiny_checkpoint(tmp_path / "src", tokenizer=make_tiny_tokenizer(), num_hidden_layers=1)
    argv = [str(src), str(tmp_path / "q"), "--device", "gpu0", "--calib-data", str(tmp_path / "none")]
    assert cli.run_quantize(parse(argv)) == 2
    assert "eightbit quantize: error: --device: device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu0'" in \
        capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_quiet_run_reports_the_errors_the_checkpoint_records(tmp_path, capsys):
    """--no-progress: no bar and no note (every window asked for was found); stdout names OUT and gives each
    smoothing point's error unsmoothed -> smoothed, as config.json records them."""
    import re

    src, calib = tiny_source(tmp_path, num_hidden_layers=2)
    argv = [str(src), str(tmp_path / "q"), "--calib-data", str(calib), "--num-samples", "2", "--seq-len", "32",
            "--no-progress"]
    capsys.readouterr()  # make_tiny_checkpoint's own bar
    assert cli.run_quantize(parse(argv)) == 0
    out, err = capsys.readouterr()
    assert err == ""  # no bar (layers, tokenizing) and no "fewer windows" note
    summary = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["eightbit"][
        "calibration"]
    assert summary["data"]["num_samples"] == 2
    lines = out.splitlines()
    assert lines[0] == f"wrote {tmp_path / 'q'}"
    head, _, body = lines[1].partition(": ")
    assert head == "mean W8A8 relative error per smoothing point (unsmoothed -> smoothed)"
    shown = {m[0]: (float(m[1]), float(m[2])) for m in re.findall(r"(\w+) (\S+) -> (\S+?)(?:,|$)", body)}
    assert set(shown) == set(summary["mean_error"]) and len(shown) >= 2
    for point, (before, after) in shown.items():
        assert before == pytest.approx(summary["mean_error_unsmoothed"][point], rel=6e-3)
        assert after == pytest.approx(summary["mean_error"][point], rel=6e-3)
    assert any(b != pytest.approx(a, rel=2e-2) for b, a in shown.values())  # the two columns can be told apart


def test_python_m_quant_cli_is_the_quantize_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "quantize", lambda *a, **k: pytest.fail("quantize ran"))
    assert cli.main([str(tmp_path / "x.gguf")]) == 2
    assert capsys.readouterr().err.startswith(f"eightbit quantize: error: {tmp_path / 'x.gguf'} is named like a model")
    monkeypatch.setattr("sys.argv", ["eightbit.quant.cli", str(tmp_path / "y.safetensors")])
    assert cli.main() == 2 and "y.safetensors is named like a model file" in capsys.readouterr().err


def test_ctrl_c_while_replacing_an_output_says_out_is_untouched(tmp_path, capsys, monkeypatch):
    """Interrupted while the new checkpoint is written (here: its tokenizer), `eightbit quantize --overwrite` keeps
    the earlier output byte for byte, and says so on one line, exit 130."""
    from transformers import PreTrainedTokenizerBase

    from eightbit.cli import main

    src, calib = tiny_source(tmp_path)
    argv = ["quantize", str(src), str(tmp_path / "q"), "--calib-data", str(calib), "--num-samples", "2",
            "--seq-len", "32", "--no-progress"]
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "q").iterdir()}
    capsys.readouterr()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", interrupted)
    assert main(argv + ["--overwrite", "--alpha", "0.5"]) == 130
    assert capsys.readouterr().err == ("\neightbit quantize: interrupted; OUT is as it was before the run "
                                       "(written atomically)\n")
    assert {p.name: p.read_bytes() for p in (tmp_path / "q").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "q", "src"]


SIGTERM_DURING_THE_SWAP = """
import os, signal, sys
from pathlib import Path
from eightbit.cli import main
from eightbit.quant import writer
out, rename = Path(sys.argv[1]), os.rename

def interrupted_rename(a, b):  # the old checkpoint moved aside: systemd stops the service now
    rename(a, b)
    if Path(a) == out:
        signal.raise_signal(signal.SIGTERM)

writer.os.rename = interrupted_rename
sys.exit(main(sys.argv[2:]))
"""


def test_a_sigterm_during_the_swap_leaves_the_new_checkpoint_and_nothing_else(tmp_path):
    """SIGTERM (its default action: the process ends) is held back while the new checkpoint replaces the old one;
    raised after the two renames it ended the process before the old checkpoint, moved aside, was removed. (A
    process of its own: the default action would end pytest.)"""
    import subprocess
    import sys

    from eightbit.quant.checkpoint_format import read_calibration_summary

    src, calib = tiny_source(tmp_path)
    out = tmp_path / "q"
    argv = ["quantize", str(src), str(out), "--calib-data", str(calib), "--num-samples", "2", "--seq-len", "32",
            "--no-progress", "--overwrite"]
    from eightbit.cli import main

    assert main(argv + ["--alpha", "0.25"]) == 0
    run = subprocess.run([sys.executable, "-c", SIGTERM_DURING_THE_SWAP, str(out), *argv, "--alpha", "0.75"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 128 + signal.SIGTERM, run.stderr
    assert read_calibration_summary(json.loads((out / "config.json").read_text()))["alpha"] == 0.75
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "q", "src"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_ctrl_c_as_the_new_output_moves_in_says_out_holds_it(tmp_path, capsys, monkeypatch, overwrite):
    """A Ctrl-C that lands as the finished checkpoint moves to OUT (held back during a swap, or just after a rename):
    OUT holds the new checkpoint, and the message says that, not that OUT is as it was. Nothing is left beside it."""
    from eightbit.cli import main
    from eightbit.quant import writer
    from eightbit.quant.checkpoint_format import read_calibration_summary

    src, calib = tiny_source(tmp_path)
    out = tmp_path / "q"
    argv = ["quantize", str(src), str(out), "--calib-data", str(calib), "--num-samples", "2", "--seq-len", "32",
            "--no-progress"]
    if overwrite:
        assert main(argv + ["--alpha", "0.25"]) == 0
    rename = os.rename

    def interrupted_rename(a, b):  # OUT's first rename: the old one moved aside, or the new one moved in
        rename(a, b)
        if out in (Path(a), Path(b)):
            monkeypatch.setattr(writer.os, "rename", rename)
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(writer.os, "rename", interrupted_rename)
    capsys.readouterr()
    assert main(argv + ["--alpha", "0.75", "--overwrite"]) == 130
    err = capsys.readouterr().err
    assert err == f"\neightbit quantize: interrupted; {out} holds the new checkpoint, complete (the interrupt came as it " \
                  "was moved there)\n"
    assert read_calibration_summary(json.loads((out / "config.json").read_text()))["alpha"] == 0.75
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "q", "src"]
