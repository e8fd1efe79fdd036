"""Report writer, configuration parsing, data-dir resolution, and the eval CLI end to end on a tiny run."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from eightbit.eval import report
from eightbit.eval.configs import CONFIGS, ENV_DATA, parse_configs, resolve_data_dir

PPL_ROWS = [
    {"config": "bf16", "backend": "engine", "baseline": "bf16", "ppl": 10.0, "weight_bytes": 270e6,
     "kv_bytes_per_token": 23040, "windows": 2, "scored_tokens": 100, "seconds": 3.0},
    {"config": "kv8-g32", "backend": "engine", "baseline": "bf16", "ppl": 10.02, "weight_bytes": 270e6,
     "kv_bytes_per_token": 12960, "windows": 2, "scored_tokens": 100, "seconds": 3.0},
    {"config": "kv8-g8", "backend": "engine", "baseline": "bf16", "ppl": 10.01, "weight_bytes": 270e6,
     "kv_bytes_per_token": 17280, "windows": 2, "scored_tokens": 100, "seconds": 3.0},
    {"config": "bnb-int8", "backend": "hf", "baseline": "hf-bf16", "error": "not runnable here: no CUDA"},
]
PEER_ROWS = [  # a peer's Δ is against its own HF baseline, not eightbit's bf16
    {"config": "hf-bf16", "backend": "hf", "baseline": "hf-bf16", "ppl": 10.5},
    {"config": "torchao-int8", "backend": "hf", "baseline": "hf-bf16", "ppl": 10.71},
]


def test_ppl_table_deltas_and_errors():
    deltas = report.ppl_deltas(PPL_ROWS)
    assert deltas["bf16"] == 0.0 and deltas["kv8-g32"] == pytest.approx(0.2)
    assert deltas["bnb-int8"] is None
    deltas = report.ppl_deltas(PPL_ROWS + PEER_ROWS)
    assert deltas["torchao-int8"] == pytest.approx(2.0) and deltas["kv8-g32"] == pytest.approx(0.2)
    table = report.ppl_table(PPL_ROWS)
    assert "| kv8-g32 | engine | 10.0200 | +0.20% | bf16 |" in table
    assert "| bf16 | engine | 10.0000 | — | bf16 |" in table  # the baseline itself: no Δ, as docs/evals.md shows
    assert "not runnable here: no CUDA" in table
    assert table.count("\n") == len(PPL_ROWS) + 1


def test_ppl_chart_and_json(tmp_path):
    png = report.ppl_chart(PPL_ROWS, tmp_path / "c" / "ppl.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path = report.write_json(tmp_path / "ppl.json", {"meta": {"x": 1}, "rows": PPL_ROWS})
    assert json.loads(path.read_text())["rows"][1]["ppl"] == 10.02


def test_tasks_table_paired_deltas(tmp_path):
    def task(outcomes):
        return {"items": 4, "acc": sum(outcomes) / 4, "acc_norm": 0.5,
                "outcomes": {"acc": outcomes, "acc_norm": [1, 0, 1, 0]}}

    rows = [
        {"config": "bf16", "backend": "engine", "baseline": "bf16", "tasks": {"arc_easy": task([1, 1, 0, 1])}},
        {"config": "kv8", "backend": "engine", "baseline": "bf16", "tasks": {"arc_easy": task([1, 0, 0, 0])}},
    ]
    d = report.task_deltas(rows, "arc_easy", "acc")
    assert d["kv8"]["diff"] == pytest.approx(-50.0)
    peers = [{"config": "hf-bf16", "backend": "hf", "baseline": "hf-bf16", "tasks": {"arc_easy": task([0, 0, 0, 1])}},
             {"config": "bnb-int8", "backend": "hf", "baseline": "hf-bf16", "tasks": {"arc_easy": task([1, 0, 0, 1])}}]
    d = report.task_deltas(rows + peers, "arc_easy", "acc")  # paired with hf-bf16 (+25), not with bf16 (-25)
    assert d["bnb-int8"]["diff"] == pytest.approx(25.0) and d["kv8"]["diff"] == pytest.approx(-50.0)
    assert d["kv8"]["stderr"] == pytest.approx(100 * math.sqrt(1 / 3 / 4))
    table = report.tasks_table(rows, ["arc_easy"])
    assert "| kv8 | engine | 25.00 (-50.00 ± 28.87) | 50.00 (+0.00 ± 0.00) |" in table
    assert "arc_easy: 4 items" in table
    assert report.tasks_chart(rows, ["arc_easy"], tmp_path / "t.png").is_file()


def test_parse_configs_groups_and_errors():
    names = [c.name for c in parse_configs("parity,kv-sweep,bf16")]
    assert names == ["fp32", "hf-fp32", "bf16", "hf-bf16", "kv8-g8", "kv8-g16", "kv8-g32", "kv8-g64"]
    assert CONFIGS["kv8"].kv_cache_dtype == "int8" and CONFIGS["w8a8-sq+kv8"].weights == "smoothquant"
    with pytest.raises(ValueError, match="unknown configuration"):
        parse_configs("bf16,nope")


def test_resolve_data_dir_order(tmp_path, monkeypatch):
    assert resolve_data_dir(tmp_path) == tmp_path
    monkeypatch.setenv(ENV_DATA, str(tmp_path))
    assert resolve_data_dir() == tmp_path
    monkeypatch.setenv(ENV_DATA, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="EIGHTBIT_DATA"):
        resolve_data_dir()
    monkeypatch.delenv(ENV_DATA)
    assert (resolve_data_dir() / "wikitext-2").is_dir()  # <repo>/../shared/data
    with pytest.raises(FileNotFoundError):
        resolve_data_dir(tmp_path / "nope")


def test_eval_cli_ppl_end_to_end(tmp_path, capsys, hf_model, tokenizer):
    from eightbit.eval.cli import main
    from eightbit.eval.perplexity import wikitext_text

    rc = main(["ppl", "--configs", "fp32", "--windows", "1", "--window-size", "48", "--device", "cpu",
               "--kv-cache-memory-gb", "0.25", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    payload = json.loads((tmp_path / "ppl.json").read_text())
    rows = {r["config"]: r for r in payload["rows"]}
    # the reference: HF transformers' float32 loss on the test text's first 48 tokens
    window = tokenizer(wikitext_text(resolve_data_dir()), add_special_tokens=False).input_ids[:48]
    with torch.no_grad():
        loss = hf_model(torch.tensor([window]), labels=torch.tensor([window])).loss.item()
    assert rows["fp32"]["ppl"] == pytest.approx(math.exp(loss), rel=1e-4) and rows["fp32"]["scored_tokens"] == 47
    assert payload["meta"]["windows"] == 1 and payload["meta"]["window"] == 48
    assert payload["meta"]["data"]["wikitext"]["published"] and payload["meta"]["data_note"] == ""
    assert (tmp_path / "ppl.png").is_file() and "| fp32 | engine |" in (tmp_path / "ppl.md").read_text()
    assert "WikiText-2 raw test, 1/" in capsys.readouterr().out


def test_eval_cli_keeps_an_earlier_runs_results_unless_told(tmp_path, capsys, monkeypatch):
    import eightbit.eval.configs as configs
    from eightbit.eval.cli import main

    monkeypatch.setattr(configs, "load_tokenizer", lambda *a: pytest.fail("nothing may load"))
    (tmp_path / "ppl.json").write_text("an earlier run")
    assert main(["ppl", "--configs", "fp32", "--out", str(tmp_path)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "ppl.json").read_text() == "an earlier run"
    assert main(["ppl", "--configs", "fp32", "--windows", "0", "--out", str(tmp_path / "new")]) == 2
    assert "--windows must be >= 1" in capsys.readouterr().err
    assert main(["tasks", "--configs", "fp32", "--limit", "0", "--out", str(tmp_path / "new")]) == 2
    assert "--limit must be >= 1" in capsys.readouterr().err
    assert main(["ppl", "--configs", "fp32", "--kv-cache-memory-gb", "0", "--out", str(tmp_path / "new")]) == 2
    assert "--kv-cache-memory-gb must be > 0" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")  # found after scoring, the results were lost to a FileExistsError
    assert main(["ppl", "--configs", "fp32", "--out", str(tmp_path / "afile")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert main(["ppl", "--configs", "fp32", "--out", str(tmp_path / "afile" / "sub")]) == 2  # under a file
    assert f"{tmp_path / 'afile'} is a file, not a folder" in capsys.readouterr().err
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    real_access = os.access  # root writes anywhere (CI runs as root): the check is what is tested
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == locked else real_access(path, mode))
    assert main(["ppl", "--configs", "fp32", "--out", str(locked / "new")]) == 2
    assert "is not writable" in capsys.readouterr().err
    monkeypatch.setattr(os, "access", real_access)
    if not torch.cuda.is_available():
        assert main(["ppl", "--configs", "fp32", "--device", "cuda", "--out", str(tmp_path / "new")]) == 2
        assert "no CUDA GPU" in capsys.readouterr().err
    # each configuration loaded its model and failed with a traceback
    assert main(["ppl", "--configs", "fp32", "--device", "tpu", "--out", str(tmp_path / "new")]) == 2
    assert "--device tpu: device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'" in capsys.readouterr().err
    assert main(["ppl", "--configs", "fp32", "--window-size", "1", "--out", str(tmp_path / "new")]) == 2
    assert "--window-size must be >= 2" in capsys.readouterr().err
    assert main(["ppl", "--configs", "fp32", "--window-size", "0", "--out", str(tmp_path / "new")]) == 2
    assert "--window-size must be >= 2" in capsys.readouterr().err  # said ">= 1", which 1 does not meet
    # passed eval's check, then failed every engine configuration after loading it
    assert main(["ppl", "--configs", "fp32", "--kv-cache-memory-gb", "inf", "--out", str(tmp_path / "new")]) == 2
    assert "--kv-cache-memory-gb must be > 0" in capsys.readouterr().err
    assert main(["tasks", "--configs", "fp32", "--tasks", ",", "--out", str(tmp_path / "new")]) == 2
    assert "--tasks names no task" in capsys.readouterr().err  # said "unknown tasks []"
    assert main(["ppl", "--configs", "fp32", "--data-dir", "", "--out", str(tmp_path / "new")]) == 2
    assert "--data-dir is empty" in capsys.readouterr().err  # fell through to $EIGHTBIT_DATA or the default
    assert not (tmp_path / "new").exists()  # a refused run makes no folder


def test_an_interrupted_run_leaves_its_json_table_and_chart_agreeing(tmp_path, monkeypatch, capsys):
    """The markdown table and the chart are rewritten with the JSON after every configuration: an interrupted
    --overwrite run left its new JSON beside the earlier run's table and chart."""
    import eightbit.eval.configs as configs
    from eightbit.eval.cli import main

    real = configs.build_scorer

    def build(config, **kw):
        if config.name == "bf16":
            raise KeyboardInterrupt
        return real(config, **kw)

    (tmp_path / "ppl.md").write_text("| bf16 | engine | 15.1374 | an earlier run |")
    monkeypatch.setattr(configs, "build_scorer", build)
    rc = main(["ppl", "--configs", "fp32,bf16", "--windows", "1", "--window-size", "48", "--device", "cpu",
               "--kv-cache-memory-gb", "0.25", "--out", str(tmp_path), "--no-progress", "--overwrite"])
    assert rc == 130 and f"interrupted; what finished before it is in {tmp_path}" in capsys.readouterr().err
    rows = json.loads((tmp_path / "ppl.json").read_text())["rows"]
    table = (tmp_path / "ppl.md").read_text()
    assert [r["config"] for r in rows] == ["fp32"] and "| fp32 | engine |" in table and "15.1374" not in table
    assert (tmp_path / "ppl.png").read_bytes().startswith(b"\x89PNG")


PPL_ARGS = ["ppl", "--configs", "fp32", "--windows", "1", "--window-size", "48", "--device", "cpu",
            "--kv-cache-memory-gb", "0.25", "--no-progress", "--overwrite"]


def test_a_ctrl_c_while_the_chart_is_drawn_writes_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    """The chart takes seconds (matplotlib's import): an interrupt there left the JSON and the table without a chart,
    beside a message that nothing was written. Now nothing of that configuration is, and an earlier run's three
    files stay as they were."""
    import eightbit.eval.report as report
    from eightbit.eval.cli import main

    earlier = {"ppl.json": '{"rows": []}', "ppl.md": "| an earlier run |", "ppl.png": "an earlier chart"}
    for name, text in earlier.items():
        (tmp_path / name).write_text(text)

    def interrupted_chart(rows, path, **kw):
        path.write_bytes(b"half a chart")
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "ppl_chart", interrupted_chart)
    assert main([*PPL_ARGS, "--out", str(tmp_path)]) == 130
    assert f"interrupted; nothing had finished: nothing was written to {tmp_path}" in capsys.readouterr().err
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == earlier  # and no partial file beside them


def test_a_ctrl_c_while_the_json_is_written_leaves_no_temporary_file(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    from eightbit.eval.cli import main

    real_replace = Path.replace

    def replace(self, target):
        if Path(target).name == "ppl.partial.json":  # write_json's own temporary file is in place
            raise KeyboardInterrupt
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", replace)
    assert main([*PPL_ARGS, "--out", str(tmp_path)]) == 130
    assert "nothing was written" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_ctrl_c_as_the_results_move_into_place_waits_for_all_three(tmp_path, monkeypatch, capsys):
    import signal
    from pathlib import Path

    from eightbit.eval.cli import main

    real_replace = Path.replace

    def replace(self, target):
        if Path(target).name == "ppl.md":  # between the JSON's move and the chart's
            signal.raise_signal(signal.SIGINT)
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", replace)
    assert main([*PPL_ARGS, "--out", str(tmp_path)]) == 130
    assert f"interrupted; what finished before it is in {tmp_path}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ppl.json", "ppl.md", "ppl.png"]
    assert [r["config"] for r in json.loads((tmp_path / "ppl.json").read_text())["rows"]] == ["fp32"]
    assert "| fp32 |" in (tmp_path / "ppl.md").read_text()
    assert (tmp_path / "ppl.png").read_bytes().startswith(b"\x89PNG")


def test_no_window_is_an_error_before_any_model_loads(tmp_path, monkeypatch, capsys):
    import eightbit.eval.configs as configs
    from eightbit.eval.cli import main

    (tmp_path / "data" / "wikitext-2").mkdir(parents=True)
    (tmp_path / "data" / "wikitext-2" / "wiki.test.raw").write_text("")
    monkeypatch.setattr(configs, "build_scorer", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["ppl", "--configs", "fp32", "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "o")]) == 2
    assert "not one window" in capsys.readouterr().err


def test_the_chart_says_no_baseline_where_the_table_shows_a_dash(tmp_path, monkeypatch):
    texts = []
    import matplotlib.axes

    real = matplotlib.axes.Axes.text
    monkeypatch.setattr(matplotlib.axes.Axes, "text", lambda self, x, y, s, **kw: texts.append(s) or real(self, x, y, s, **kw))
    rows = [dict(PPL_ROWS[1], config="kv8-g32")]  # its baseline bf16 is not in the run
    assert "| kv8-g32 | engine | 10.0200 | — |" in report.ppl_table(rows)
    report.ppl_chart(rows, tmp_path / "ppl.png")
    assert texts == [" no baseline (ppl 10.020)"]


def test_task_errors_are_shown_in_the_table():
    rows = [{"config": "bf16", "backend": "engine", "baseline": "bf16", "tasks": {},
             "task_errors": {"lambada": "ValueError: the prompt is longer than max_model_len"}}]
    assert "error: ValueError: the prompt is longer than max_model_len" in report.tasks_table(rows, ["lambada"])
    # a task no configuration finished still has its size in the footer (the run's item counts)
    assert report.tasks_table(rows, ["lambada"], {"lambada": 5}).endswith("\n\nlambada: 5 items")


def test_eval_cli_header_and_chart_when_a_configuration_fails(tmp_path, capsys, monkeypatch):
    """The header counts the scored tokens of the first row that has them, and an earlier run's chart is not
    left beside a run that draws none."""
    import eightbit.eval.configs as configs
    from eightbit.eval.cli import main

    real = configs.build_scorer

    def build(config, **kw):
        if config.name == "fp32":
            raise RuntimeError("no fp32 today")
        return real(config, **kw)

    monkeypatch.setattr(configs, "build_scorer", build)
    (tmp_path / "ppl.png").write_text("an earlier run's chart")
    args = ["ppl", "--windows", "1", "--window-size", "48", "--device", "cpu", "--kv-cache-memory-gb", "0.25",
            "--out", str(tmp_path), "--no-progress", "--overwrite"]
    assert main(args + ["--configs", "fp32,bf16"]) == 1
    assert "(47 scored tokens)" in (tmp_path / "ppl.md").read_text()
    assert (tmp_path / "ppl.png").read_bytes().startswith(b"\x89PNG")
    assert main(args + ["--configs", "fp32"]) == 1
    assert "(0 scored tokens)" in (tmp_path / "ppl.md").read_text() and not (tmp_path / "ppl.png").exists()


def test_eval_tasks_caps_its_context_at_the_models(tmp_path, capsys):
    """--max-model-len (default 2048) above the model's context is capped: every configuration failed to load."""
    from eightbit.eval.cli import main
    from eightbit.quant.testing import make_tiny_checkpoint, make_tiny_tokenizer

    from transformers.utils import logging as hf_logging

    src = make_tiny_checkpoint(tmp_path / "tiny", tokenizer=make_tiny_tokenizer())  # a context of 256
    try:
        rc = main(["tasks", "--model", str(src), "--configs", "fp32", "--tasks", "arc_easy", "--limit", "2",
                   "--device", "cpu", "--kv-cache-memory-gb", "0.05", "--out", str(tmp_path / "out"),
                   "--no-progress"])
        assert not hf_logging.is_progress_bar_enabled()  # --no-progress: transformers' bars too
    finally:
        hf_logging.enable_progress_bar()
    assert "--max-model-len 2048 capped at the model's context, 256" in capsys.readouterr().out
    assert rc == 0
    rows = json.loads((tmp_path / "out" / "tasks.json").read_text())["rows"]
    assert [r["config"] for r in rows] == ["fp32"] and rows[0]["tasks"]["arc_easy"]["items"] == 2


def test_eval_ppl_caps_its_window_at_the_models_context(tmp_path, capsys):
    """--window-size (default 2048) above the model's context: windows of context - 1 tokens (room for the token
    the engine samples), not windows every configuration refuses."""
    from eightbit.eval.cli import main
    from eightbit.quant.testing import make_tiny_checkpoint, make_tiny_tokenizer

    src = make_tiny_checkpoint(tmp_path / "tiny", tokenizer=make_tiny_tokenizer())  # a context of 256
    rc = main(["ppl", "--model", str(src), "--configs", "fp32", "--windows", "1", "--device", "cpu",
               "--kv-cache-memory-gb", "0.05", "--out", str(tmp_path / "out"), "--no-progress"])
    assert rc == 0
    payload = json.loads((tmp_path / "out" / "ppl.json").read_text())
    assert payload["meta"]["window"] == 255 and payload["rows"][0]["scored_tokens"] == 254
    assert "windows of 255" in capsys.readouterr().out


def test_eval_tasks_refuses_requests_longer_than_the_context_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """A task item longer than --max-model-len failed each configuration only after its model had loaded."""
    import eightbit.eval.configs as configs
    from eightbit.eval.cli import main

    monkeypatch.setattr(configs, "build_scorer", lambda *a, **k: pytest.fail("no model may load"))
    rc = main(["tasks", "--configs", "fp32,kv8", "--tasks", "arc_easy,lambada", "--limit", "3", "--device", "cpu",
               "--max-model-len", "64", "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "do not fit --max-model-len 64" in err and "pass --max-model-len" in err, err
    assert "arc_easy" in err or "lambada" in err
    assert not (tmp_path / "out" / "tasks.json").exists()


def fake_scorers(monkeypatch, interrupt_at=None, fail_at=None, calls=None):
    """Stand-ins for the configurations' models: log-likelihood = -(tokens), all greedy; Ctrl-C or an error at
    LAMBADA (the one task that asks for greedy); each call's request count appended to `calls`."""
    import eightbit.eval.configs as configs
    from eightbit.eval.configs import Score, Scorer

    class Fake(Scorer):
        def loglikelihood(self, requests, need_greedy=False, progress=None):
            if calls is not None:
                calls.append(len(requests))
            if need_greedy and interrupt_at == "lambada":
                raise KeyboardInterrupt
            if need_greedy and fail_at == "lambada":
                raise ValueError("the lambada scorer broke")
            return [Score(-float(len(t)), True, len(t) - s) for t, s in requests]

    monkeypatch.setattr(configs, "build_scorer", lambda config, **kw: Fake(config))


def test_an_interrupted_tasks_run_keeps_the_tasks_it_finished(tmp_path, monkeypatch, capsys):
    """Results were written only after all of a configuration's tasks: a Ctrl-C during the last one (hours into a
    CPU run) lost them all."""
    from eightbit.eval.cli import main

    fake_scorers(monkeypatch, interrupt_at="lambada")
    rc = main(["tasks", "--configs", "bf16", "--limit", "3", "--out", str(tmp_path), "--no-progress"])
    assert rc == 130 and f"interrupted; what finished before it is in {tmp_path}" in capsys.readouterr().err
    (row,) = json.loads((tmp_path / "tasks.json").read_text())["rows"]
    assert list(row["tasks"]) == ["arc_easy", "hellaswag"] and row["unfinished"] == ["lambada"]
    assert all(row["tasks"][t]["items"] == 3 for t in row["tasks"])
    assert "| bf16 (unfinished) | engine |" in (tmp_path / "tasks.md").read_text()


def test_a_one_item_run_writes_strict_json(tmp_path, monkeypatch):
    """The standard error of one item is NaN, written as a bare NaN that strict JSON parsers refuse."""
    from eightbit.eval.cli import main

    fake_scorers(monkeypatch)
    assert main(["tasks", "--configs", "bf16", "--tasks", "lambada", "--limit", "1", "--out", str(tmp_path),
                 "--no-progress"]) == 0

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    (row,) = json.loads((tmp_path / "tasks.json").read_text(), parse_constant=refuse)["rows"]
    assert row["tasks"]["lambada"]["acc"] == 1.0 and row["tasks"]["lambada"]["acc_stderr"] is None
    assert "unfinished" not in row


def test_a_task_that_fails_makes_the_run_fail(tmp_path, monkeypatch):
    from eightbit.eval.cli import main

    fake_scorers(monkeypatch, fail_at="lambada")
    rc = main(["tasks", "--configs", "bf16", "--tasks", "arc_easy,lambada", "--limit", "2", "--out", str(tmp_path),
               "--no-progress"])
    (row,) = json.loads((tmp_path / "tasks.json").read_text())["rows"]
    assert "lambada scorer broke" in row["task_errors"]["lambada"] and "arc_easy" in row["tasks"]
    assert rc == 1  # a missing result is not a successful run


def test_a_task_named_twice_is_scored_once(tmp_path, monkeypatch):
    from eightbit.eval.cli import main

    calls = []
    fake_scorers(monkeypatch, calls=calls)
    assert main(["tasks", "--configs", "bf16", "--tasks", "lambada,lambada", "--limit", "2", "--out", str(tmp_path),
                 "--no-progress"]) == 0
    assert calls == [2]
    assert (tmp_path / "tasks.md").read_text().count("lambada acc") == 1
    assert list(json.loads((tmp_path / "tasks.json").read_text())["meta"]["items"]) == ["lambada"]


def test_ppl_meta_counts_every_window_of_the_text(tmp_path, monkeypatch):
    """With --windows N the header must still say how many windows the whole text has (N of them were scored)."""
    from eightbit.eval.cli import main
    from eightbit.eval.configs import load_tokenizer
    from eightbit.eval.perplexity import wikitext_text

    data = tmp_path / "data"
    (data / "wikitext-2").mkdir(parents=True)
    (data / "wikitext-2" / "wiki.test.raw").write_text(" = Title = \n \n The cat sat on the mat , and then it left the "
                                                       "room for the garden . \n")
    ids = load_tokenizer()(wikitext_text(data), add_special_tokens=False).input_ids
    expected = len(ids) // 8 + (len(ids) % 8 >= 2)  # windows of 8; a tail of one token scores nothing
    assert expected >= 3
    fake_scorers(monkeypatch)
    assert main(["ppl", "--configs", "bf16", "--data-dir", str(data), "--windows", "1", "--window-size", "8",
                 "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    meta = json.loads((tmp_path / "o" / "ppl.json").read_text())["meta"]
    assert meta["windows"] == 1 and meta["total_windows"] == expected
    assert f"1/{expected} windows of 8 tokens" in (tmp_path / "o" / "ppl.md").read_text()


def test_a_request_as_long_as_max_model_len_is_refused_before_loading():
    # the engine samples one token after the prompt and refuses a prompt of max_model_len tokens
    # (LLMEngine.check_request): eval must refuse such a request before any model loads, and say what helps
    from eightbit.eval.cli import _check_requests_fit

    configs = [CONFIGS["bf16"]]
    _check_requests_fit({"lambada": [([1] * 63, 62)]}, 64, 2048, configs)  # 63 + 1 sampled = 64: fits
    with pytest.raises(ValueError, match=r"requests of up to 64 tokens \(lambada: 64\) do not fit --max-model-len 64"
                                         r".*pass --max-model-len 65 or more"):
        _check_requests_fit({"lambada": [([1] * 64, 63)]}, 64, 2048, configs)
    with pytest.raises(ValueError, match="pass --max-model-len 65 or more"):  # 65 = the model's context: fits
        _check_requests_fit({"lambada": [([1] * 64, 63)]}, 64, 65, configs)
    with pytest.raises(ValueError, match="the model's context is 64 tokens"):  # 65 > the model's 64: no flag helps
        _check_requests_fit({"lambada": [([1] * 64, 63)]}, 64, 64, configs)
    _check_requests_fit({"lambada": [([1] * 64, 63)]}, 64, 2048, [CONFIGS["hf-bf16"]])  # the peers have no such limit


def _task_result(outcomes):
    return {"items": 4, "acc": sum(outcomes) / 4, "acc_norm": 0.5,
            "outcomes": {"acc": outcomes, "acc_norm": [1, 0, 1, 0]}}


def test_the_baseline_row_of_the_tasks_table_has_no_delta():
    rows = [{"config": "bf16", "backend": "engine", "baseline": "bf16", "tasks": {"arc_easy": _task_result([1, 1, 0, 1])}},
            {"config": "kv8", "backend": "engine", "baseline": "bf16", "tasks": {"arc_easy": _task_result([1, 0, 0, 0])}}]
    table = report.tasks_table(rows, ["arc_easy"])
    assert "| bf16 | engine | 75.00 | 50.00 |" in table  # as in the ppl table: a baseline is not compared with itself


def test_the_tasks_table_has_no_acc_norm_column_for_lambada():
    rows = [{"config": "bf16", "backend": "engine", "baseline": "bf16",
             "tasks": {"lambada": {"items": 2, "acc": 0.5, "outcomes": {"acc": [1, 0]}}}}]
    lines = report.tasks_table(rows, ["lambada", "arc_easy"]).splitlines()
    assert lines[0] == ("| config | backend | lambada acc (Δ ± paired se) | arc_easy acc (Δ ± paired se) "
                        "| arc_easy acc_norm (Δ ± paired se) |")
    assert lines[2] == "| bf16 | engine | 50.00 | — | — |"


def test_write_json_turns_infinities_into_null(tmp_path):
    # strict JSON has no inf: a perplexity that overflowed must not lose the results file at the end of a run
    path = report.write_json(tmp_path / "x.json", {"rows": [{"ppl": float("inf"), "d": -float("inf")}]})
    assert json.loads(path.read_text()) == {"rows": [{"ppl": None, "d": None}]}


def test_empty_parts_of_configs_are_skipped():
    assert [c.name for c in parse_configs("bf16,")] == ["bf16"]  # a trailing comma, as --tasks takes one
    assert [c.name for c in parse_configs(" fp32 , , bf16 ")] == ["fp32", "bf16"]
    with pytest.raises(ValueError, match="no configurations given"):
        parse_configs(" , ")
