"""eval/tune_gemm's choices (CPU): the committed table entry or a re-tune's fastest candidate; PDL or not; a clear
error where there is no GPU to tune on."""

import pytest
import torch

from eightbit.eval import tune_gemm
from eightbit.eval.tune_gemm import choose, choose_pdl
from eightbit.kernels.gemm_configs import GemmConfig

OLD = GemmConfig(16, 64, 256, 1, 1, 4, 6)
NEW = GemmConfig(16, 16, 256, 1, 1, 1, 6)
OTHER = GemmConfig(16, 32, 256, 1, 2, 4, 4)


def test_choose_keeps_the_committed_entry_unless_clearly_beaten():
    assert choose({OLD: 10.0, NEW: 9.9, OTHER: 10.5}, OLD) == OLD  # 1 % faster: the run's noise
    assert choose({OLD: 10.0, NEW: 9.81, OTHER: 10.5}, OLD) == OLD  # just under 2 %
    assert choose({OLD: 10.0, NEW: 9.79, OTHER: 10.5}, OLD) == NEW  # just over 2 %
    assert choose({OLD: 10.0, NEW: 9.5}, OLD, min_gain=0.06) == OLD
    assert choose({OLD: 9.0, NEW: 9.5}, OLD) == OLD  # the committed entry is still the fastest


def test_choose_takes_the_fastest_without_a_timed_committed_entry():
    assert choose({OLD: 10.0, NEW: 9.9}) == NEW  # a bucket the table did not hold
    assert choose({NEW: 9.9, OTHER: 9.7}, OLD) == OTHER  # the committed config failed its exactness check


def test_choose_pdl_keeps_the_unmarked_launch_unless_clearly_beaten():
    # a "ws" entry, or a Triton one above PDL_MAX_M: launched plainly unless PDL is >= 2 % faster
    assert choose_pdl(10.0, 9.9, default=False) is False
    assert choose_pdl(10.0, 9.79, default=False) is True
    assert choose_pdl(10.0, 11.0, default=False) is False
    # a Triton entry up to PDL_MAX_M: PDL unless the plain launch is >= 2 % faster
    assert choose_pdl(9.9, 10.0, default=True) is True
    assert choose_pdl(9.79, 10.0, default=True) is False
    assert choose_pdl(11.0, 10.0, default=True) is True
    assert choose_pdl(10.0, 9.5, default=False, min_gain=0.06) is False


def test_a_new_bucket_is_timed_against_the_entry_that_served_it():
    """A bucket added to M_BUCKETS (640 between 512 and 768) is compared with the next bucket up's entry, which its
    M ran until now, so a re-tune keeps that entry unless a candidate beats it."""
    table = {(512, 2048, 2048): OLD, (768, 2048, 2048): NEW, (640, 4096, 4096): OTHER}
    assert tune_gemm.previous_entry(table, 512, 2048, 2048) == OLD
    assert tune_gemm.previous_entry(table, 640, 2048, 2048) == NEW
    assert tune_gemm.previous_entry(table, 100, 2048, 2048) == OLD
    assert tune_gemm.previous_entry(table, 1024, 2048, 2048) is None  # nothing above: the caller's default
    assert tune_gemm.previous_entry(table, 640, 3072, 2048) is None  # another shape's entries do not count


def test_tune_gemm_without_a_gpu_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "table.json"
    for flags in ([], ["--pdl"], ["--behind-quant", "--buckets", "128"], ["--in-layer", "--buckets", "1"]):
        with pytest.raises(SystemExit, match="CUDA GPU"):
            tune_gemm.main(flags + ["--out", str(out)])
    assert not out.exists()  # nothing written


def test_tune_gemm_rejects_conflicting_modes(tmp_path, capsys):
    out = tmp_path / "table.json"
    for flags in (["--pdl", "--behind-quant", "--buckets", "128"], ["--behind-quant"],
                  ["--in-layer", "--behind-quant", "--buckets", "1"], ["--in-layer"]):
        with pytest.raises(SystemExit) as e:
            tune_gemm.main(flags + ["--out", str(out)])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with argument" in err and "--behind-quant needs --buckets" in err
    assert "argument --behind-quant: not allowed with argument --in-layer" in err
    assert "--in-layer needs --buckets" in err
    with pytest.raises(SystemExit):
        tune_gemm.main(["--in-layer", "--buckets", "1,512", "--out", str(out)])
    assert "--in-layer times decode steps, of at most 256 sequences" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a misspelt kernel would time only the committed entries and the defaults
        tune_gemm.main(["--kernels", "swap,wss", "--buckets", "4", "--out", str(out)])
    assert "--kernels: unknown wss" in capsys.readouterr().err
    assert not out.exists()


def _table_file(path, configs, device="NVIDIA H200"):
    import json

    path.write_text(json.dumps(dict(device=device, date="2026-11-28", configs=configs)))
    return str(path)


def _entry(mb, n, k, cfg, **extra):
    return dict(m_bucket=mb, n=n, k=k, config=cfg.to_dict() | extra)


def test_device_overrides_keep_only_what_launches_differently(tmp_path):
    import json

    base = _table_file(tmp_path / "base.json", [_entry(8, 64, 64, OLD), _entry(16, 64, 64, OLD), _entry(32, 64, 64, OLD),
                                                _entry(8, 128, 64, OLD)], device="NVIDIA H100")
    out = tmp_path / "by_device.json"
    out.write_text(json.dumps({"Other GPU": {"configs": [_entry(8, 64, 64, NEW)]},
                               "NVIDIA H200": {"configs": [_entry(32, 64, 64, OTHER) | {"source": "old.json"},
                                                           _entry(8, 128, 64, NEW)]}}))
    tuned = _table_file(tmp_path / "h200.json", [
        _entry(8, 64, 64, NEW, pdl=True),  # a new config: kept
        _entry(16, 64, 64, OLD, pdl=True),  # the same config, marked as the rule launches it anyway: not kept
        _entry(32, 64, 64, NEW),  # outside --buckets: not taken, the earlier entry there stays
        _entry(8, 128, 64, OLD)])  # re-tuned back to the table's config: the earlier entry goes
    assert tune_gemm.write_device_entries(tuned, base, str(out), buckets={8, 16}) == 0
    data = json.loads(out.read_text())
    assert data["Other GPU"] == {"configs": [_entry(8, 64, 64, NEW)]}
    mine = {(e["m_bucket"], e["n"], e["k"]): GemmConfig(**e["config"]) for e in data["NVIDIA H200"]["configs"]}
    assert mine == {(8, 64, 64): NEW, (32, 64, 64): OTHER}
    sources = {(e["m_bucket"], e["n"], e["k"]): e.get("source") for e in data["NVIDIA H200"]["configs"]}
    assert sources == {(8, 64, 64): "h200.json", (32, 64, 64): "old.json"}  # an entry kept from before keeps its own


def test_device_overrides_need_another_card_named(tmp_path):
    base = _table_file(tmp_path / "base.json", [_entry(8, 64, 64, OLD)], device="NVIDIA H100")
    unnamed = _table_file(tmp_path / "t.json", [_entry(8, 64, 64, NEW)], device="")
    with pytest.raises(SystemExit, match="names no device"):
        tune_gemm.write_device_entries(unnamed, base, str(tmp_path / "o.json"), {8})
    same = _table_file(tmp_path / "s.json", [_entry(8, 64, 64, NEW)], device="NVIDIA H100")
    with pytest.raises(SystemExit, match="tuned on NVIDIA H100 itself"):
        tune_gemm.write_device_entries(same, base, str(tmp_path / "o.json"), {8})
    assert not (tmp_path / "o.json").exists()  # nothing written


def test_device_overrides_drop_a_card_left_without_entries(tmp_path):
    import json

    base = _table_file(tmp_path / "base.json", [_entry(8, 64, 64, OLD)], device="NVIDIA H100")
    out = tmp_path / "o.json"
    out.write_text(json.dumps({"NVIDIA H200": {"configs": [_entry(8, 64, 64, NEW)]}}))
    back = _table_file(tmp_path / "t.json", [_entry(8, 64, 64, OLD)])
    tune_gemm.write_device_entries(back, base, str(out), {8})
    assert json.loads(out.read_text()) == {}


def test_device_overrides_need_buckets(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune_gemm.main(["--device-overrides", str(tmp_path / "t.json")])
    assert exit_info.value.code == 2 and "--device-overrides needs --buckets" in capsys.readouterr().err


def test_device_overrides_run_without_a_gpu(tmp_path, monkeypatch):
    from eightbit.kernels import gemm_configs as gc

    base = _table_file(tmp_path / "base.json", [_entry(8, 64, 64, OLD)], device="NVIDIA H100")
    tuned = _table_file(tmp_path / "t.json", [_entry(8, 64, 64, NEW)])
    monkeypatch.setattr(gc, "TABLE_PATH", base)
    monkeypatch.setattr(gc, "BY_DEVICE_PATH", str(tmp_path / "o.json"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune_gemm.main(["--device-overrides", tuned, "--buckets", "8"]) == 0
    assert "NVIDIA H200" in (tmp_path / "o.json").read_text()


def test_device_overrides_keep_an_older_cards_source_on_its_kept_entries(tmp_path):
    """A per-card file written before entries named their source (one "source" for the card) keeps it on the
    entries that stay."""
    import json

    base = _table_file(tmp_path / "base.json", [_entry(8, 64, 64, OLD), _entry(16, 64, 64, OLD)], device="NVIDIA H100")
    out = tmp_path / "by_device.json"
    out.write_text(json.dumps({"NVIDIA H200": {"source": "older.json", "date": "2026-11-01",
                                               "configs": [_entry(16, 64, 64, OTHER)]}}))
    tuned = _table_file(tmp_path / "new.json", [_entry(8, 64, 64, NEW)])
    tune_gemm.write_device_entries(tuned, base, str(out), buckets={8})
    got = {e["m_bucket"]: (e["source"], e["date"]) for e in json.loads(out.read_text())["NVIDIA H200"]["configs"]}
    assert got == {8: ("new.json", "2026-11-28"), 16: ("older.json", "2026-11-01")}


def test_device_overrides_keep_the_record_of_an_entry_filed_again_unchanged(tmp_path):
    """Filing one new entry of a bucket files the card's other entries there again (the tuned table holds them,
    as the card ran them): those keep the source, date and times of the run that chose them."""
    import json

    base = _table_file(tmp_path / "base.json", [_entry(8, 64, 64, OLD), _entry(8, 128, 64, OLD)], device="NVIDIA H100")
    out = tmp_path / "by_device.json"
    first = dict(_entry(8, 128, 64, OTHER), us=10.0, source="first.json", date="2026-11-01")
    out.write_text(json.dumps({"NVIDIA H200": {"configs": [first]}}))
    tuned = _table_file(tmp_path / "second.json", [dict(_entry(8, 64, 64, NEW), us=5.0),
                                                   dict(_entry(8, 128, 64, OTHER), us=11.0)])
    tune_gemm.write_device_entries(tuned, base, str(out), buckets={8})
    got = {(e["n"], e["source"], e["us"]) for e in json.loads(out.read_text())["NVIDIA H200"]["configs"]}
    assert got == {(64, "second.json", 5.0), (128, "first.json", 10.0)}


def test_in_layer_timing_puts_the_candidate_in_its_gemms_place_in_its_models_layers(monkeypatch):
    from eightbit.eval import decode_layers

    built, timed = [], []

    class FakeLayers:
        def __init__(self, model, batch):
            built.append((model, batch))

        def time_us(self, configs):
            timed.append(configs)
            return 42.0

    monkeypatch.setattr(decode_layers, "DecodeLayers", FakeLayers)
    cfg = GemmConfig(16, 32, 512, 1, 1, 2, 3)
    model, time_in_layer = tune_gemm.in_layer_timer(2048, 8192, 4)  # Llama-3.2-1B's down
    assert (model, built) == ("llama-3.2-1b", [("llama-3.2-1b", 4)])
    assert time_in_layer(cfg) == 42.0 and timed == [{"down": cfg}]
    with pytest.raises(ValueError, match="N=100, K=64"):
        tune_gemm.in_layer_timer(100, 64, 4)


def test_swap_candidates_hold_their_bucket_and_are_configs_the_kernel_has():
    """The swapped small-M kernel is a candidate up to bucket 64, its activation tile the smallest of 8-64 rows
    that holds the bucket (a config whose rows M exceeds would run the dot kernel instead)."""
    from eightbit.kernels.int8_gemm_swap import config_ok

    for m, rows in ((1, 8), (2, 8), (4, 8), (8, 8), (16, 16), (32, 32), (64, 64)):
        swaps = [c for c in tune_gemm.candidates(m) if c.kernel == "swap"]
        assert swaps and all(c.block_m == rows and config_ok(c) for c in swaps), m
    assert not [c for c in tune_gemm.candidates(128) if c.kernel == "swap"]
