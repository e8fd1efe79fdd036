"""EIGHTBIT_GEMM_TABLE (another table in place of the committed one) and the engine A/B of two tables
(eval/ab_gemm_table.py), with the engine runs faked: what each run is given, how the runs are judged, and the
refusals."""

import itertools
import json
import os
import types

import pytest
import torch

from eightbit.eval import ab_gemm_table as ab
from eightbit.kernels import gemm_configs as gc
from eightbit.kernels.gemm_configs import GemmConfig

MINE = GemmConfig(16, 32, 512, 1, 1, 2, 3)


def _fresh_caches(monkeypatch):
    for name, empty in (("_table", None), ("_merged", {}), ("_memo", {})):
        monkeypatch.setattr(gc, name, empty)


def _table(path, entries):
    path.write_text(json.dumps(dict(device="Fake GPU", configs=[
        dict(m_bucket=mb, n=n, k=k, config=cfg.to_dict()) for (mb, n, k), cfg in entries.items()])))
    return str(path)


def test_the_env_table_replaces_the_committed_one(tmp_path, monkeypatch):
    committed = gc.table_entries()
    (mb, n, k), cfg = next((key, c) for key, c in committed.items() if key[0] == 8)
    assert cfg != MINE
    monkeypatch.setenv(gc.TABLE_ENV, _table(tmp_path / "t.json", {(mb, n, k): MINE}))
    _fresh_caches(monkeypatch)
    assert gc.table_path() == str(tmp_path / "t.json")
    assert gc.get_config(mb, n, k) == MINE
    other = next(key for key in committed if key[0] == 64)
    assert gc.get_config(*other) == gc.default_config(*other)  # not in that table: the default, not the committed
    monkeypatch.delenv(gc.TABLE_ENV)
    _fresh_caches(monkeypatch)
    assert gc.table_path() == gc.TABLE_PATH and gc.get_config(mb, n, k) == cfg


def test_a_missing_or_malformed_env_table_is_an_error_that_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv(gc.TABLE_ENV, str(tmp_path / "none.json"))
    _fresh_caches(monkeypatch)
    with pytest.raises(FileNotFoundError, match="EIGHTBIT_GEMM_TABLE=.*none.json: no such file"):
        gc.get_config(8, 4096, 4096)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"entries": []}))
    monkeypatch.setenv(gc.TABLE_ENV, str(bad))
    _fresh_caches(monkeypatch)
    with pytest.raises(ValueError, match="bad.json is not a GEMM table"):
        gc.get_config(8, 4096, 4096)


def _args(tmp_path, **kw):
    return ["cand.json", "--out", str(tmp_path / "ab"), *[x for k, v in kw.items() for x in (f"--{k}", str(v))]]


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """A candidate table in the working directory (the committed table's entries, one changed), and a fake CUDA
    card whose own entries replace the candidate's at (32, N, K)."""
    monkeypatch.chdir(tmp_path)
    entries = gc.table_entries()
    (mb, n, k) = next(key for key in entries if key[0] == 32)
    _table(tmp_path / "cand.json", {**entries, (mb, n, k): MINE})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ab, "device_name_of", lambda device: "Fake GPU")
    monkeypatch.setattr(ab, "device_entries", lambda name: {(mb, n, k): GemmConfig(32, 64, 256, 1, 1, 4, 4)})
    return types.SimpleNamespace(dir=tmp_path, hidden=(mb, n, k))


def test_ab_runs_baseline_candidate_candidate_baseline_and_judges_each_batch(tables, capsys):
    speeds = {"baseline": {1: [100, 102, 101, 99], 32: [200, 201, 199, 202], 64: [300, 305, 301, 306]},
              "candidate": {1: [95, 96, 97, 94], 32: [210, 212, 211, 209], 64: [303, 299, 304, 300]}}
    calls = []

    def fake_run(table, out_dir, args):
        arm = "candidate" if table.endswith("cand.json") else "baseline"
        i = sum(1 for c in calls if c[0] == arm)
        calls.append((arm, os.path.basename(out_dir), args.batch_sizes))
        return {b: v[i] for b, v in speeds[arm].items()}

    assert ab.main(_args(tables.dir, **{"batch-sizes": "1,32,64"}), run=fake_run) == 0
    assert [c[0] for c in calls] == list(ab.ORDER) * 2
    assert [c[1] for c in calls] == [f"{i:02d}_{arm}" for i, arm in enumerate(ab.ORDER * 2)]
    saved = json.loads((tables.dir / "ab" / "ab.json").read_text())
    rows = {r["batch"]: r for r in saved["rows"]}
    assert {b: r["verdict"] for b, r in rows.items()} == {1: "loses", 32: "wins", 64: "within the spread"}
    assert rows[32]["bucket"] == 32 and rows[32]["change"] == pytest.approx(210.5 / 200.5 - 1)
    assert saved["runs"][1] == {"arm": "candidate", "gbs": [[1, 95], [32, 210], [64, 303]]}
    assert saved["tables"]["baseline"] == gc.TABLE_PATH  # the table in use
    out = capsys.readouterr().out
    assert "won in every run: buckets 32" in out and "--device-overrides cand.json --buckets 32" in out
    assert f"not measured, though filing those buckets files them: the candidate's entries at (M bucket, N, K) " \
           f"{tables.hidden}" in out
    assert "only one of the tables" not in out
    assert f"this card's own entries replace 1 of the candidate's in both arms, so they compare equal, e.g. " \
           f"(M bucket, N, K) [{tables.hidden}]" in out
    assert "4 runs per arm" in out and "1 time in 70" in out and "some one of these 3 up to 3 in 70" in out


def test_a_bucket_wins_only_if_every_batch_size_in_it_won():
    rows = [dict(bucket=64, verdict="wins"), dict(bucket=64, verdict="within the spread"),
            dict(bucket=32, verdict="wins"), dict(bucket=4, verdict="loses")]
    assert ab.winning_buckets(rows) == [32]


def test_the_chance_of_wins_by_noise_is_counted_over_every_order_of_the_runs():
    for n in (1, 2, 3, 4):  # every split of 2n distinct speeds into n baseline and n candidate runs
        splits = list(itertools.combinations(range(2 * n), n))
        wins = sum(min(c) > max(set(range(2 * n)) - set(c)) for c in splits)
        assert ab.chance_of_wins_by_noise(n) == pytest.approx(wins / len(splits))
    row = dict(batch=4, bucket=4, baseline=[1.0, 2.0], candidate=[3.0, 4.0], change=1.0, verdict="wins")
    assert "2 runs per arm" in ab.render([row], "c.json") and "1 time in 6" in ab.render([row], "c.json")
    assert "some one of these 2 up to 2 in 6" in ab.render([row, dict(row, batch=3)], "c.json")


def _fake_engine(records, returncode=0, seen=None):
    def fake_subprocess_run(cmd, env, stdout, stderr):
        if seen is not None:
            seen.update(cmd=cmd, table=env[gc.TABLE_ENV], by_device=env.get("EIGHTBIT_GEMM_BY_DEVICE"))
        out = cmd[cmd.index("--out") + 1]
        with open(os.path.join(out, "results.jsonl"), "w") as f:
            f.write("\n".join(json.dumps(r) for r in records) + "\n")
        stdout.write("engine log\n")
        return types.SimpleNamespace(returncode=returncode)
    return fake_subprocess_run


def test_run_arm_points_the_engine_at_its_table_and_reads_its_records(tmp_path, monkeypatch):
    seen = {}
    records = [dict(bench="copy", ok=True), dict(bench="latency", ok=True, batch=4, achieved_gbs=2700.0),
               dict(bench="latency", ok=True, batch=8, achieved_gbs=2800.0)]
    monkeypatch.setattr(ab.subprocess, "run", _fake_engine(records, seen=seen))
    args = types.SimpleNamespace(model="llama-3-8b", batch_sizes="4,8", prompt_len=512, new_tokens=64,
                                 card_entries="on")
    assert ab.run_arm("/t/cand.json", str(tmp_path / "r"), args) == {4: 2700.0, 8: 2800.0}
    assert seen["table"] == "/t/cand.json" and seen["cmd"][seen["cmd"].index("--batch-sizes") + 1] == "4,8"
    assert (tmp_path / "r" / "run.log").read_text() == "engine log\n"
    assert seen["by_device"] is None  # the card's own entries apply as usual
    args.card_entries = "off"
    ab.run_arm("/t/cand.json", str(tmp_path / "r_off"), args)
    assert seen["by_device"] == "0"


def test_card_entries_off_compares_the_candidate_with_what_the_card_runs_now(tables, capsys):
    tables_seen = []

    def fake_run(table, out_dir, args):
        tables_seen.append((table, args.card_entries))
        return {32: 100.0}

    assert ab.main(_args(tables.dir, **{"batch-sizes": "32", "card-entries": "off"}), run=fake_run) == 0
    in_use = str(tables.dir / "ab" / "in_use.json")
    assert {t for t, _ in tables_seen} == {in_use, str(tables.dir / "cand.json")}
    assert {mode for _, mode in tables_seen} == {"off"}
    baseline = gc.read_table(in_use)  # the committed table with the (fake) card's entry in place
    committed = gc.table_entries()
    assert baseline[tables.hidden] == GemmConfig(32, 64, 256, 1, 1, 4, 4) != committed[tables.hidden]
    assert {key: c for key, c in baseline.items() if key != tables.hidden} == \
           {key: c for key, c in committed.items() if key != tables.hidden}
    out = capsys.readouterr().out
    assert "own entries replace" not in out and "not measured" not in out  # nothing of the candidate is hidden


def test_run_arm_stops_on_a_failed_run_or_a_batch_without_bandwidth(tmp_path, monkeypatch):
    args = types.SimpleNamespace(model="llama-3-8b", batch_sizes="4,8", prompt_len=512, new_tokens=64,
                                 card_entries="on")
    monkeypatch.setattr(ab.subprocess, "run", _fake_engine([], returncode=3))
    with pytest.raises(SystemExit, match="failed \\(exit code 3\\): see .*r1/run.log"):
        ab.run_arm("/t/cand.json", str(tmp_path / "r1"), args)
    records = [dict(bench="latency", ok=True, batch=4, achieved_gbs=2700.0),
               dict(bench="latency", ok=False, batch=8, achieved_gbs=None, error="OutOfMemoryError: CUDA out of memory")]
    monkeypatch.setattr(ab.subprocess, "run", _fake_engine(records))
    with pytest.raises(SystemExit, match="no decode bandwidth at batch 8: OutOfMemoryError: CUDA out of memory"):
        ab.run_arm("/t/cand.json", str(tmp_path / "r2"), args)
    build_failed = [dict(bench="latency", ok=False, batch=None, error="build failed: ValueError: bad config")]
    monkeypatch.setattr(ab.subprocess, "run", _fake_engine(build_failed))
    with pytest.raises(SystemExit, match="no decode bandwidth at batch 4: build failed: ValueError: bad config"):
        ab.run_arm("/t/cand.json", str(tmp_path / "r3"), args)


def test_ab_refuses_before_running_anything(tables, monkeypatch, capsys):
    def never(*a):
        raise AssertionError("no engine run expected")

    (tables.dir / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit, match="bad.json is not a GEMM table"):
        ab.main(["bad.json", "--out", str(tables.dir / "x")], run=never)
    (tables.dir / "odd.json").write_text(json.dumps({"configs": [{"m_bucket": 8, "n": 64, "k": 64, "config": {"tile": 3}}]}))
    with pytest.raises(SystemExit, match="odd.json is not a GEMM table.*TypeError"):
        ab.main(["odd.json", "--out", str(tables.dir / "x")], run=never)
    (tables.dir / "empty.json").write_text(json.dumps({"configs": []}))
    with pytest.raises(SystemExit, match="empty.json holds no entries"):
        ab.main(["empty.json", "--out", str(tables.dir / "x")], run=never)
    with pytest.raises(SystemExit, match="the candidate is the baseline itself"):
        ab.main(["cand.json", "--baseline", "cand.json", "--out", str(tables.dir / "x")], run=never)
    (tables.dir / "used").mkdir()
    (tables.dir / "used" / "00_baseline").mkdir()
    with pytest.raises(SystemExit, match="is not empty"):
        ab.main(["cand.json", "--out", str(tables.dir / "used")], run=never)
    with pytest.raises(SystemExit) as e:
        ab.main(_args(tables.dir, **{"batch-sizes": "1,x"}), run=never)
    assert e.value.code == 2 and "comma-separated integers" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _table(tables.dir / "part.json", {(8, 64, 64): MINE})
    with pytest.raises(SystemExit, match="has none"):
        ab.main(["part.json", "--out", str(tables.dir / "ab")], run=never)
    assert "entries are in only one of the tables" in capsys.readouterr().out  # a partial candidate is warned of
    assert not (tables.dir / "ab").exists() and not (tables.dir / "x").exists()


def test_a_fresh_process_reads_the_table_the_env_names(tmp_path):
    """What each A/B arm relies on: the engine's process, started with EIGHTBIT_GEMM_TABLE, looks its GEMMs up there."""
    import subprocess
    import sys

    path = _table(tmp_path / "t.json", {(8, 64, 64): MINE})
    code = "from eightbit.kernels import gemm_configs as gc; print(gc.get_config(7, 64, 64).key())"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **{gc.TABLE_ENV: path}),
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(MINE.key())
