"""The one end-to-end conversion of the real embedded model (SmolLM2-135M-Instruct GGUF)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from eightbit.quant.checkpoint_format import read_calibration_summary, read_quantization_config
from eightbit.quant.int8 import dequantize

TEXT = (
    " = Valkyria Chronicles III = \n\n Senjō no Valkyria 3 : Unrecorded Chronicles is a tactical role @-@ playing "
    "video game developed by Sega and Media.Vision for the PlayStation Portable . Released in January 2011 in "
    "Japan , it is the third game in the Valkyria series . The game began development in 2010 , carrying over a "
    "large portion of the work done on Valkyria Chronicles II . While it retained the standard features of the "
    "series , it also underwent multiple adjustments , such as making the game more forgiving for series "
    "newcomers . Character designer Raita Honjou and composer Hitoshi Sakimoto both returned from previous "
    "entries , along with Valkyria Chronicles II director Takeshi Ozawa .\n" * 3
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from eightbit.engine.weights import open_checkpoint

    ckpt = open_checkpoint(None)  # the embedded model: missing is an error (the README's test command installs it)
    d = tmp_path_factory.mktemp("smol")
    calib = d / "calib.txt"
    calib.write_text(TEXT)
    from eightbit.calibrate.data import load_calibration_text, make_windows
    from eightbit.quant.convert import convert

    tok = ckpt.load_tokenizer()
    cs = make_windows(load_calibration_text(str(calib)), tok, num_samples=2, seq_len=64)
    # a fixed alpha: the grid search (tested on tiny models) would multiply the weight work by 5
    summary = convert(ckpt, d / "q", cs, alpha=0.6, progress=False, tokenizer=tok, sample_tokens=128)
    return ckpt, tok, d / "q", summary


def test_structure(smollm2):
    ckpt, _, out, summary = smollm2
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30 and cfg["num_key_value_heads"] == 3 and cfg["tie_word_embeddings"]
    assert read_quantization_config(cfg).kv_cache.group_size == 32
    rec = read_calibration_summary(cfg)
    assert rec["data"]["num_samples"] == 2 and rec["data"]["tokens"] == 128 and len(rec["layers"]) == 30
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors"):
        assert (out / name).is_file(), name
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen.get("eos_token_id") in (2, [2])
    t = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in t  # tied
    assert len([n for n in t if n.endswith(".weight_scale")]) == 30 * 7
    assert t["model.embed_tokens.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(t["model.embed_tokens.weight"],
                               ckpt.get_tensor("model.embed_tokens.weight").to(torch.bfloat16), rtol=0, atol=0)
    size = (out / "model.safetensors").stat().st_size
    assert 150e6 < size < 175e6  # int8 linears (106M) + bf16 embedding (57M)


def test_dequantized_model_reproduces_the_source(smollm2):
    from transformers import AutoModelForCausalLM

    ckpt, tok, out, _ = smollm2
    t = load_file(out / "model.safetensors")
    deq = {n: (dequantize(x, t[n + "_scale"]) if x.dtype == torch.int8 else x.float())
           for n, x in t.items() if not n.endswith("_scale")}
    ids = torch.tensor(tok(TEXT)["input_ids"][:96]).unsqueeze(0)
    logits = []
    for state in ({n: ckpt.get_tensor(n) for n in ckpt.tensor_names()}, deq):
        with torch.device("meta"):  # no random init of 135M parameters
            model = AutoModelForCausalLM.from_config(ckpt.config, dtype=torch.float32).eval()
        state = {n: x.float() for n, x in state.items()}
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])  # tied
        model.load_state_dict(state, strict=True, assign=True)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)  # its buffers are computed
        with torch.no_grad():
            logits.append(model(ids).logits[0])
        del model
    ref, got = logits
    # smoothing folded exactly, int8 per-channel weights: the float model's predictions survive
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    ref_lp, got_lp = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (ref_lp.exp() * (ref_lp - got_lp)).sum(-1).mean()
    assert kl < 0.05, kl
