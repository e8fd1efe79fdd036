"""eval/bench_gc.py on the llama-tiny dummy model with the model stubbed out (CPU): both arms, what they record."""

import json

import pytest

from eightbit.eval.bench_gc import main


def test_both_arms_run_the_same_steps_and_only_the_frozen_one_leaves_the_start_up_heap_out(tmp_path, capsys):
    out = tmp_path / "gc.json"
    main(["--model", "llama-tiny", "--stub-model", "--device", "cpu", "--requests", "250", "--batch", "100",
          "--prompt-len", "8", "--new-tokens", "6", "--json", str(out)])
    frozen, other = json.loads(out.read_text())
    assert (frozen["arm"], other["arm"]) == ("frozen", "not frozen")
    # three rounds (100, 100, 50 requests), each one prefill step and then 5 decode steps
    assert frozen["steps"] == other["steps"] == 3 * 5
    # what a full collection walks: a few thousand objects made since start-up against torch's and the model's
    assert frozen["tracked_objects"] < 0.1 * other["tracked_objects"]
    for arm in (frozen, other):
        assert sorted(arm["collections"]) == ["gen0", "gen1", "gen2"]
        assert arm["slowest_decode_step_ms"] > 0
    table = capsys.readouterr().out
    assert "not frozen / frozen: slowest decode step" in table and table.count(" 250 ") == 2


@pytest.mark.parametrize("bad", [["--requests", "0"], ["--batch", "0"], ["--new-tokens", "1"]])
def test_bad_counts_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        main(bad)
    assert "must be at least 1, --new-tokens at least 2" in capsys.readouterr().err


def test_an_arm_that_fails_stops_the_run_with_its_error():
    with pytest.raises(SystemExit, match="the 'frozen' arm failed:(.|\n)*no-such-shape"):
        main(["--model", "no-such-shape", "--device", "cpu", "--requests", "1"])
