"""eval/bench_host.py on the llama-tiny dummy model (CPU): the stub, the step accounting, the CLI."""

import json

import pytest
import torch

from eightbit import SamplingParams
from eightbit.eval.bench_engine import build_llm, run_requests
from eightbit.eval.bench_host import bench_host, format_results, main, stub_model


@pytest.fixture
def tiny_llm():
    return build_llm("eightbit-int8", "llama-tiny", "cpu", dtype="float32", kv_cache_memory_gb=0.01, max_model_len=256)


def test_stub_model_replaces_the_forward_and_the_logits(tiny_llm):
    fixed = stub_model(tiny_llm.engine)
    tiny_llm.engine.model.model.forward = None  # the stub must not need the real forward
    out = tiny_llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert out[0].outputs[0].token_ids == [int(fixed[0].argmax())] * 5  # a batch of one samples row 0 every step


def test_bench_host_counts_the_decode_steps(tiny_llm):
    stub_model(tiny_llm.engine)
    new_tokens = 12
    results = bench_host(tiny_llm, [1, 3], prompt_len=20, new_tokens=new_tokens)
    assert [r["batch"] for r in results] == [1, 3]
    for r in results:
        # the prefill step gives each request its first token; the rest come one decode step each, less the first
        # two and the last two steps that bench_host leaves out
        assert r["steps"] == new_tokens - 1 - 4
        assert r["gpu_us"] is None  # no CUDA events off the GPU
    assert not tiny_llm.engine.has_unfinished_requests() and tiny_llm.engine.block_manager.num_used_blocks == 0


def test_final_only_requests_report_twice_and_time_the_same_decode_steps(tiny_llm):
    stub_model(tiny_llm.engine)
    prompts, lens = [[1, 2, 3, 4], [5, 6, 7], [8, 9]], [6, 6, 6]
    every = run_requests(tiny_llm.engine, prompts, lens)
    final = run_requests(tiny_llm.engine, prompts, lens, final_only=True)
    for run in (every, final):
        assert list(run["ntok"].values()) == lens and set(run["first"]) == set(run["last"]) == set(run["rids"])
    # reported every step: the prefill step and five decode steps; final-only: the first token's step and the end's
    assert [s[1] for s in every["steps"]] == [3] * 6
    assert [s[1] for s in final["steps"]] == [3, 3]
    assert bench_host(tiny_llm, [3], prompt_len=20, new_tokens=12, final_only=True)[0]["steps"] == 12 - 1 - 4
    assert not tiny_llm.engine.has_unfinished_requests() and tiny_llm.engine.block_manager.num_used_blocks == 0


def test_format_results_says_what_paced_each_batch():
    rows = [dict(batch=8, steps=10, step_us=900.0, wait_us=400.0, gpu_us=880.0),
            dict(batch=256, steps=10, step_us=4000.0, wait_us=15.0, gpu_us=2600.0),
            dict(batch=8, steps=10, step_us=1029.0, wait_us=12.0, gpu_us=1042.0),  # balanced: no wait, GPU-paced
            dict(batch=64, steps=10, step_us=1000.0, wait_us=300.0, gpu_us=None)]  # no span: the wait decides
    table = format_results(rows, "m", stub=False).splitlines()
    assert [line.split()[-1] for line in table[2:]] == ["GPU", "host", "GPU", "GPU"]
    assert table[3].split()[5] == "15.6"  # µs a sequence: 4000 / 256
    assert format_results(rows, "m", stub=True).splitlines()[3].split()[-1] == "-"  # nothing to pace a stub


def test_cli_writes_json(tmp_path, capsys):
    path = tmp_path / "host.json"
    assert main(["--model", "llama-tiny", "--stub-model", "--device", "cpu", "--batch-sizes", "2",
                 "--prompt-len", "16", "--new-tokens", "9", "--json", str(path)]) == 0
    saved = json.loads(path.read_text())
    assert saved["stub"] is True and [r["batch"] for r in saved["results"]] == [2]
    assert saved["results"][0]["steps"] == 9 - 1 - 4
    assert len(saved["python_loop_us"]) == 2 and all(t > 0 for t in saved["python_loop_us"])  # before and after
    out = capsys.readouterr().out
    assert "model stubbed out" in out and f"took {saved['python_loop_us'][0]:.0f} µs before" in out
    assert main(["--model", "llama-tiny", "--stub-model", "--device", "cpu", "--batch-sizes", "2",
                 "--prompt-len", "16", "--new-tokens", "9", "--final-only", "--json", str(path)]) == 0
    saved = json.loads(path.read_text())
    assert saved["final_only"] is True and saved["results"][0]["steps"] == 9 - 1 - 4
    assert "reported at the first token and the end" in capsys.readouterr().out
