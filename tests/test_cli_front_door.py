"""The `eightbit` front door (eightbit/cli.py): its dispatch to the subcommands, the error line and exit code of a
refused run, the console script's sys.argv, and `generate`'s flags and per-prompt headers (review s62)."""

import pytest

from eightbit import SamplingParams
from eightbit.cli import main
from eightbit.quant.testing import make_tiny_checkpoint, make_tiny_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    """A tiny random Llama with a chat template: a model loads in a second."""
    tok = make_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", tokenizer=tok, num_hidden_layers=1), tok


@pytest.fixture
def no_model(monkeypatch):
    import eightbit

    monkeypatch.setattr(eightbit, "LLM", lambda *a, **k: pytest.fail("a model was loaded"))


def test_a_refused_run_is_one_error_line_naming_the_command(capsys, no_model):
    assert main(["generate", "hi", ""]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "eightbit generate: error: a prompt is empty\n")


def test_a_missing_file_or_folder_is_an_error_line_too(tmp_path, capsys, tiny_chat_model):
    """FileNotFoundError (eval's data folder, here) is a refused run like a ValueError: a line, exit 2."""
    src, _ = tiny_chat_model
    missing = tmp_path / "no-data"
    assert main(["eval", "ppl", "--configs", "fp32", "--model", str(src), "--data-dir", str(missing),
                 "--device", "cpu", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"eightbit eval: error: --data-dir {missing} is not a directory\n"
    assert not (tmp_path / "o").exists()


def test_the_console_script_reads_sys_argv(capsys, monkeypatch, no_model):
    """The `eightbit` entry point calls main() with no arguments: the command line is sys.argv[1:]."""
    monkeypatch.setattr("sys.argv", ["eightbit", "generate", "hi", ""])
    assert main() == 2
    assert capsys.readouterr().err == "eightbit generate: error: a prompt is empty\n"


def test_no_subcommand_or_no_prompt_is_a_usage_error(capsys, no_model):
    for argv, missing in (([], "command"), (["generate"], "PROMPT")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "the following arguments are required: " + missing in err, err
        assert err.startswith("usage: eightbit")


@pytest.mark.parametrize("command, words", [
    ("generate", "PROMPT"), ("quantize", "eightbit quantize SRC OUT"), ("eval", "{ppl,tasks}"),
    ("bench", "usage: eightbit bench"), ("serve", "--port"),
])
def test_every_subcommand_is_there(capsys, command, words):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0 and words in capsys.readouterr().out


def test_generate_passes_every_option_and_heads_each_prompt_with_its_own_text(tiny_chat_model, capsys, monkeypatch):
    """Engine flags reach the LLM, sampling flags each request; with --chat each templated prompt runs, and the
    header of its output shows the prompt as typed. The text is LLM.generate's for the same prompt and params."""
    import eightbit

    src, tok = tiny_chat_model
    real_llm, made, streamed = eightbit.LLM, [], []

    def spy(model, **options):
        llm = real_llm(model, **options)
        made.append((model, options))
        real_stream = llm.stream
        llm.stream = lambda prompt, params: streamed.append((prompt, params)) or real_stream(prompt, params)
        return llm

    monkeypatch.setattr(eightbit, "LLM", spy)
    prompts = ["the cat", "a dog and the man"]
    rc = main(["generate", "--model", str(src), "--dtype", "float32", "--device", "cpu", "--max-model-len", "128",
               "--kv-cache-dtype", "int8", "--kv-group-size", "16", "--quantization", "w8a8", "--max-tokens", "5",
               "--temperature", "0.7", "--top-p", "0.9", "--seed", "11", "--chat", *prompts])
    out = capsys.readouterr().out
    assert rc == 0
    options = dict(dtype="float32", device="cpu", max_model_len=128, kv_cache_dtype="int8", kv_group_size=16,
                   quantization="w8a8")
    assert made == [(str(src), options)]
    ref = real_llm(str(src), **options)
    want = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=11)
    expected = ""
    for i, prompt in enumerate(prompts):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids
        sent, params = streamed[i]
        assert sent == ids
        assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (5, 0.7, 0.9, 11)
        reply = ref.generate({"prompt_token_ids": ids}, want, use_tqdm=False)[0].outputs[0].text
        expected += f"--- [{i}] {prompt}\n{reply}\n"
    assert len(streamed) == 2 and out == expected


def test_generate_checks_every_prompt_before_the_first_runs(tiny_chat_model, capsys):
    """A prompt too long for --max-model-len, after one that fits: nothing is generated, not even the first."""
    src, _ = tiny_chat_model
    rc = main(["generate", "--model", str(src), "--dtype", "float32", "--device", "cpu", "--max-model-len", "32",
               "--max-tokens", "4", "the cat", "the man and the dog " * 20])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("eightbit generate: error: ") and "32" in err, err


def test_the_recorded_command_is_the_argv_given_whatever_the_entry_point(tmp_path, monkeypatch):
    """A result's meta "command" reproduces the run from the arguments main() got (here a call, where sys.argv is
    pytest's), and `python -m eightbit.eval.cli` records itself as `eightbit eval`."""
    import eightbit.eval.cli as eval_cli

    seen = []
    monkeypatch.setattr(eval_cli, "run_ppl", lambda args: seen.append(eval_cli._meta(args, {})["command"]) or 0)
    argv = ["ppl", "--configs", "fp32", "--windows", "3", "--out", str(tmp_path / "my out")]
    assert main(["eval", *argv]) == 0
    assert eval_cli.main(argv) == 0
    assert seen == [f"eightbit eval ppl --configs fp32 --windows 3 --out '{tmp_path / 'my out'}'"] * 2
