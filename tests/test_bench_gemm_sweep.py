"""bench_gemm --sweep's arguments: the M range and the shapes, and the errors for bad ones (before any GPU work)."""

import pytest

from eightbit.eval.bench_gemm import MODELS, main, parse_sweep


def test_sweep_range_includes_stop_when_the_steps_reach_it():
    ms, pairs = parse_sweep("129:198:23", "llama3.2-1b:o,llama3-8b:qkv")
    assert ms == [129, 152, 175, 198]
    assert pairs == [("llama3.2-1b", "o"), ("llama3-8b", "qkv")]
    assert parse_sweep("1:10:4")[0] == [1, 5, 9]
    assert parse_sweep("7:7:1")[0] == [7]


def test_default_sweep_shapes_are_known_shapes():
    _, pairs = parse_sweep("1:2:1")
    assert pairs and all(op in MODELS[model] for model, op in pairs)


@pytest.mark.parametrize("spec,match", [("100:50:1", "START <= STOP"), ("0:10:1", "1 <= START"),
                                        ("1:10:0", "STEP >= 1"), ("1:10", "START:STOP:STEP"),
                                        ("a:b:c", "integers")])
def test_bad_sweep_range_is_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_sweep(spec)


def test_unknown_shape_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown shape 'llama3-8b:up' \(known: .*llama3-8b:gate_up"):
        parse_sweep("1:2:1", "llama3-8b:up")


def test_main_refuses_a_bad_sweep_before_touching_the_gpu(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--sweep", "10:1:1"])
    assert exit_info.value.code == 2
    assert "--sweep needs 1 <= START <= STOP" in capsys.readouterr().err
