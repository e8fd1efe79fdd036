"""The `eightbit` command's paths: `serve`'s flags into an EngineConfig (no server, no model), `generate --chat`
against `LLM.chat`, and `eval tasks` end to end on two items of each task."""

import dataclasses
import json

import pytest
import torch

from eightbit import EngineConfig, SamplingParams
from eightbit.cli import build_parser, main
from eightbit.engine.server.cli import run_serve, serve_engine_options


def serve_config(*flags) -> EngineConfig:
    args = build_parser().parse_args(["serve", *flags])
    assert args.func is run_serve
    return EngineConfig(model=args.model, **serve_engine_options(args))


def test_serve_flags_build_the_engine_config():
    assert serve_config() == EngineConfig()  # every default is EngineConfig's own
    options = serve_engine_options(build_parser().parse_args(["serve"]))
    assert set(options) == {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    config = serve_config("--max-num-seqs", "4", "--no-enable-prefix-caching", "--kv-cache-dtype", "int8",
                          "--kv-group-size", "64", "--dtype", "float32", "--device", "cpu", "--max-model-len", "512",
                          "--block-size", "32", "--max-num-batched-tokens", "1024", "--quantization", "w8a8",
                          "--load-format", "dummy", "--gpu-memory-utilization", "0.5", "--kv-cache-memory-gb", "0.25",
                          "--num-kv-blocks", "40", "--enforce-eager", "--no-async-scheduling", "--seed", "7")
    assert config == EngineConfig(
        model=None, dtype="float32", device="cpu", max_model_len=512, block_size=32, max_num_seqs=4,
        max_num_batched_tokens=1024, enable_prefix_caching=False, kv_cache_dtype="int8", kv_group_size=64,
        quantization="w8a8", load_format="dummy", gpu_memory_utilization=0.5, kv_cache_memory_gb=0.25,
        num_kv_blocks=40, enforce_eager=True, async_scheduling=False, seed=7)
    assert isinstance(config.kv_cache_memory_gb, float) and isinstance(config.max_num_seqs, int)


def test_serve_bad_flags_fail_before_loading(capsys, monkeypatch):
    import eightbit.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "LLMEngine", lambda *a, **k: pytest.fail("no engine may load"))
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])
    assert e.value.code == 2 and "--kv-cache-dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-num-seqs", "many"])
    assert "--max-num-seqs" in capsys.readouterr().err
    assert main(["serve", "--max-num-seqs", "0", "--port", "0"]) == 2
    assert "max_num_seqs must be a positive integer" in capsys.readouterr().err


def test_generate_chat_streams_the_chat_reply(llm, capsys):
    prompt = "What is the capital of France?"
    params = SamplingParams(temperature=0, max_tokens=6)
    ref = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0].outputs[0].text
    assert ref != llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text  # the template matters here
    rc = main(["generate", "--chat", "--dtype", "float32", "--device", "cpu", "--max-model-len", "512",
               "--max-tokens", "6", prompt])
    assert rc == 0
    assert capsys.readouterr().out == ref + "\n"


def test_generate_refuses_an_empty_prompt_with_or_without_chat(capsys, monkeypatch):
    import eightbit

    monkeypatch.setattr(eightbit, "LLM", lambda *a, **k: pytest.fail("the model was loaded"))
    for flags in ([], ["--chat"]):
        assert main(["generate", *flags, "hi", ""]) == 2
        assert "a prompt is empty" in capsys.readouterr().err


def test_ctrl_c_ends_with_a_line_and_exit_130(capsys, monkeypatch, tmp_path):
    """Ctrl-C: one line on stderr instead of a traceback (eval says where its finished rows are, or that none
    had finished), exit 130."""
    import eightbit.eval.cli as eval_cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_cli, "run_tasks", interrupted)
    assert main(["eval", "tasks", "--out", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert err.strip() == f"eightbit eval: interrupted; nothing had finished: nothing was written to {tmp_path}"
    monkeypatch.setattr("eightbit.cli.run_generate", interrupted)
    assert main(["generate", "hi"]) == 130
    assert capsys.readouterr().err.strip() == "eightbit generate: interrupted"


def test_eval_cli_tasks_end_to_end(tmp_path, capsys, hf_model, tokenizer):
    from eightbit.eval.configs import resolve_data_dir
    from eightbit.eval.tasks import build_requests, load_task

    rc = main(["eval", "tasks", "--configs", "fp32", "--limit", "2", "--device", "cpu", "--max-model-len", "512",
               "--kv-cache-memory-gb", "0.25", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    payload = json.loads((tmp_path / "tasks.json").read_text())
    assert payload["meta"]["items"] == {"arc_easy": 2, "hellaswag": 2, "lambada": 2}
    data = payload["meta"]["data"]
    assert list(data) == ["arc_easy", "hellaswag", "lambada"] and all(r["published"] for r in data.values())
    # the command that reproduces the run, whatever the entry point (here a call, where sys.argv is pytest's)
    assert payload["meta"]["command"] == ("eightbit eval tasks --configs fp32 --limit 2 --device cpu "
                                          f"--max-model-len 512 --kv-cache-memory-gb 0.25 --out {tmp_path} --no-progress")
    [row] = payload["rows"]
    assert row["config"] == "fp32" and row["backend"] == "engine" and "error" not in row
    assert "task_errors" not in row and set(row["tasks"]) == {"arc_easy", "hellaswag", "lambada"}
    for task, res in row["tasks"].items():
        items = load_task(task, resolve_data_dir(), limit=2)
        requests = build_requests(items, tokenizer)
        assert res["items"] == 2 and res["requests"] == len(requests) == sum(len(i.continuations) for i in items)
        metrics = ["acc"] if task == "lambada" else ["acc", "acc_norm"]
        for m in metrics:
            assert 0.0 <= res[m] <= 1.0 and res[m] == sum(res["outcomes"][m]) / 2
        # the reference: HF transformers' float32 model on the same requests
        expected, k = {m: [] for m in metrics}, 0
        for item in items:
            lls, greedy = [], []
            for ids, start in requests[k: k + len(item.continuations)]:
                with torch.no_grad():
                    lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)
                lls.append(sum(lp[j - 1, ids[j]].item() for j in range(start, len(ids))))
                greedy.append(all(lp[j - 1].argmax().item() == ids[j] for j in range(start, len(ids))))
            k += len(item.continuations)
            if task == "lambada":
                expected["acc"].append(int(greedy[0]))
            else:
                normed = [ll / n for ll, n in zip(lls, item.lengths)]
                expected["acc"].append(int(max(range(len(lls)), key=lls.__getitem__) == item.gold))
                expected["acc_norm"].append(int(max(range(len(normed)), key=normed.__getitem__) == item.gold))
        assert res["outcomes"] == expected, task
    assert 1.0 < row["tasks"]["lambada"]["ppl"]
    assert (tmp_path / "tasks.png").is_file() and "| fp32 | engine |" in (tmp_path / "tasks.md").read_text()
    assert "arc_easy: 2 items" in capsys.readouterr().out


# --- s62: serve's option values (mutation gaps) ---------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--max-queue", "--tokenizer-workers", "--timeout-keep-alive",
                                  "--timeout-graceful-shutdown"])
def test_serve_counts_of_zero_are_refused_while_parsing(flag, capsys):
    """A queue of 0 would refuse every request with a 503, no tokenizer worker would hang every request: refused by
    argparse (exit 2, naming the flag), before anything loads; 1 is taken."""
    assert getattr(build_parser().parse_args(["serve", flag, "1"]), flag[2:].replace("-", "_")) == 1
    for value in ("0", "-3"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve", flag, value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and flag in err and f"must be at least 1, got {int(value)}" in err
    for value in ("many", "2.5"):  # argparse's message for a failed type names the type's function otherwise
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve", flag, value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {flag}: must be a whole number, got '{value}'" in err, err


def test_serve_refuses_a_load_format_it_does_not_know_while_parsing(capsys):
    from eightbit.engine.config import LOAD_FORMATS

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--load-format", "safetensors"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--load-format" in err and "invalid choice" in err
    assert all(repr(f) in err for f in LOAD_FORMATS)


def test_serve_takes_every_port_up_to_65535():
    """(A port in use here is "cannot listen", not out of range.)"""
    from eightbit.engine.server.cli import check_address

    for port in (0, 65535):
        try:
            check_address("127.0.0.1", port)
        except ValueError as e:
            assert "cannot listen" in str(e), e
    for port in (-1, 65536):
        with pytest.raises(ValueError, match=r"--port must be in \[0, 65535\]"):
            check_address("127.0.0.1", port)


def test_serve_help_gives_engine_config_s_defaults():
    """`serve --help` for the engine options not in add_engine_args: a "(default: X)" that is a value (a number, on,
    off, none, a word) is EngineConfig's default, so the help cannot drift from the config."""
    import re

    from eightbit.engine.server.cli import _ENGINE_HELP

    words = {"on": True, "off": False, "none": None}
    checked = 0
    for f in dataclasses.fields(EngineConfig):
        match = re.search(r"\(default: ([^()]*)\)$", _ENGINE_HELP.get(f.name, ""))
        if match is None or " " in match.group(1):  # e.g. "on CUDA only", "from --gpu-memory-utilization; ..."
            continue
        text = match.group(1)
        value = words[text] if text in words else type(f.default)(text)
        assert value == f.default and type(value) is type(f.default), (f.name, text, f.default)
        checked += 1
    assert checked >= 8


def test_serve_listens_on_this_machine_only_unless_told_otherwise():
    """The server has no API keys: by default it listens on a loopback address, and only pages served from this
    machine may call it from a browser."""
    import ipaddress

    args = build_parser().parse_args(["serve"])
    assert ipaddress.ip_address(args.host).is_loopback


@pytest.mark.parametrize("flags", [[], ["--served-model-name", "my-model", "--max-queue", "3", "--allowed-origins",
                                        "https://chat.example.test"]])
def test_serve_s_server_options_reach_the_app(flags, monkeypatch):
    """--served-model-name (the id /v1/models lists), --max-queue and --allowed-origins reach the app that uvicorn
    serves; by default the model's own name, no queue bound, and pages served from this machine only (CORS)."""
    import uvicorn
    from starlette.testclient import TestClient

    from eightbit.engine.server.cli import default_model_name

    seen = {}
    preflight = {"access-control-request-method": "POST"}

    def serve(server, sockets=None):  # instead of serving: ask the app
        state = server.config.app.state.server
        web = TestClient(server.config.app)
        seen["models"] = [m["id"] for m in web.get("/v1/models").json()["data"]]
        seen["max_queue"] = state.max_queue
        seen["origins"] = {origin: web.options("/v1/completions", headers={"origin": origin, **preflight}).headers.get(
            "access-control-allow-origin") for origin in ("http://localhost:3000", "https://chat.example.test",
                                                          "https://evil.test")}

    monkeypatch.setattr(uvicorn.Server, "run", serve)
    assert main(["serve", "--model", "llama-tiny", "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
                 "--kv-cache-memory-gb", "0.05", "--port", "0", "--no-engine-process", *flags]) == 0
    if flags:
        assert seen["models"] == ["my-model"] and seen["max_queue"] == 3
        assert seen["origins"] == {"http://localhost:3000": None, "https://chat.example.test":
                                   "https://chat.example.test", "https://evil.test": None}
    else:
        assert seen["models"] == [default_model_name("llama-tiny")] and seen["max_queue"] is None
        assert seen["origins"] == {"http://localhost:3000": "http://localhost:3000",
                                   "https://chat.example.test": None, "https://evil.test": None}
