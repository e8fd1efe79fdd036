"""The peers: HF transformers (fp32/bf16), bitsandbytes LLM.int8 and torchao int8 dynamic, on the same ids.

Each is loaded from the same checkpoint eightbit reads (a GGUF is dequantized by transformers'
reader, as the engine does), quantizes the same Linears (the decoder layers' projections; the
embedding and the lm_head stay in bf16, as in eightbit's W8A8), and scores the very token ids
the engine scores, so every difference in the table is the configuration's own.
"""

from __future__ import annotations

import logging
import tempfile

import torch

from eightbit.eval.configs import Score, Scorer, _batches

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PeerNotRunnable(RuntimeError):
    """The peer cannot run on this machine (e.g. bitsandbytes int8 without CUDA); the message says why."""


def _float_model(model_path, dtype):
    """HF's own LlamaForCausalLM with the checkpoint's float weights (GGUF dequantized, as the engine does)."""
    from transformers import AutoModelForCausalLM

    from eightbit.engine.weights import open_checkpoint

    ckpt = open_checkpoint(model_path)
    if ckpt.path.suffix == ".gguf":
        config = ckpt.config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = {name: ckpt.get_tensor(name) for name in ckpt.tensor_names()}
        result = model.load_state_dict(state, strict=False)  # copies: the cached tensors stay untouched
        missing = [n for n in result.missing_keys if n != "lm_head.weight" and "rotary_emb" not in n]
        if missing:
            raise RuntimeError(f"parameters not loaded from {ckpt.source}: {missing[:5]}")
        model.tie_weights()
        return model.to(dtype).eval()
    return AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=dtype).eval()


def _not_lm_head(module, fqn):
    return isinstance(module, torch.nn.Linear) and "lm_head" not in fqn


def load_peer(config, model_path=None, device="cpu"):
    """The HF model of a peer configuration, on `device`."""
    dtype = TORCH_DTYPES[config.dtype]
    if config.weights == "float":
        return _float_model(model_path, dtype).to(device)
    if config.weights == "torchao-int8":
        try:
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
        except ImportError as e:
            raise PeerNotRunnable(f"torchao is not installed ({e}); pip install torchao") from e
        model = _float_model(model_path, dtype).to(device)
        quantize_(model, Int8DynamicActivationInt8WeightConfig(), filter_fn=_not_lm_head)
        return model
    if config.weights == "bnb-int8":
        return _load_bnb(model_path, dtype, device)
    raise ValueError(f"{config.name}: no HF loader for weights={config.weights!r}")


def quiet_bitsandbytes():
    """bitsandbytes logs 'MatMul8bitLt: inputs will be cast ...' at every int8 matmul of a bf16 model (hundreds of
    lines a perplexity window), through logging, which warnings filters do not reach."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def _load_bnb(model_path, dtype, device):
    try:
        import bitsandbytes  # noqa: F401
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    except ImportError as e:
        raise PeerNotRunnable(f"bitsandbytes is not installed ({e})") from e
    quiet_bitsandbytes()
    float_model = _float_model(model_path, torch.float32)
    with tempfile.TemporaryDirectory(prefix="eightbit-bnb-") as tmp:
        float_model.save_pretrained(tmp)  # bnb quantizes during from_pretrained: go through a float export
        del float_model
        try:
            model = AutoModelForCausalLM.from_pretrained(
                tmp, dtype=dtype, device_map={"": device},
                quantization_config=BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"]),
            )
        except Exception as e:
            raise PeerNotRunnable(f"bitsandbytes LLM.int8 cannot load on {device}: {type(e).__name__}: {e}") from e
    model.eval()
    # Loading can succeed where the int8 matmul cannot run: try one token now, not mid-eval.
    try:
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]], device=device))
    except Exception as e:
        raise PeerNotRunnable(f"bitsandbytes LLM.int8 cannot run on {device}: {type(e).__name__}: {e}") from e
    return model


def model_bytes(model) -> int:
    """Bytes of the model's parameters and buffers as they sit in memory (tied tensors once)."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + list(model.buffers())
    for t in tensors:
        key = t.data_ptr() if not hasattr(t, "tensor_data_names") else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += _tensor_bytes(t)
    return total


def _tensor_bytes(t) -> int:
    inner = getattr(t, "__tensor_flatten__", None)
    if inner is not None and type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


class HFScorer(Scorer):
    """An HF transformers causal LM, right-padded batches, log-softmax in float32."""

    def __init__(self, config, model=None, device=None, max_batch_tokens=4096, hf_model=None):
        """Load the peer of `config`, or wrap an already loaded HF model (`hf_model`)."""
        super().__init__(config)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = hf_model if hf_model is not None else load_peer(config, model, self.device)
        self.max_batch_tokens = max_batch_tokens
        from eightbit.quant.schemes import kv_bytes_per_token

        hf_config = self.model.config
        float_bytes = 4 if config.dtype == "float32" else 2
        self.kv_bytes_per_token = kv_bytes_per_token(hf_config) * float_bytes / 2
        self.weight_bytes = model_bytes(self.model)
        self.info = {"model": str(model or "embedded SmolLM2-135M-Instruct"), "device": self.device}

    @torch.no_grad()
    def loglikelihood(self, requests, need_greedy=False, progress=None) -> list[Score]:
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]))
        ordered = [requests[i] for i in order]
        scores = [None] * len(requests)
        for batch in _padded_batches(ordered, self.max_batch_tokens):
            width = max(len(ordered[i][0]) for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, i in enumerate(batch):
                tokens = ordered[i][0]
                ids[row, : len(tokens)] = torch.tensor(tokens)
                mask[row, : len(tokens)] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            for row, i in enumerate(batch):
                tokens, start = ordered[i]
                scores[order[i]] = score_logits(logits[row, : len(tokens)], tokens, start, need_greedy)
            if progress is not None:
                progress.update(len(batch))
        return scores

    def close(self):
        self.model = None
        super().close()


def _padded_batches(ordered, max_tokens):
    """Batches of length-sorted requests whose padded size (rows x longest) stays within max_tokens."""
    batch, width = [], 0
    for i, (tokens, _) in enumerate(ordered):
        new_width = max(width, len(tokens))
        if batch and new_width * (len(batch) + 1) > max_tokens:
            yield batch
            batch, new_width = [], len(tokens)
        batch.append(i)
        width = new_width
    if batch:
        yield batch


def score_logits(logits, tokens, start, need_greedy=False) -> Score:
    """Score tokens[start:] from a [len(tokens), vocab] logits tensor (row j predicts token j + 1)."""
    rows = logits[start - 1 : len(tokens) - 1].float()
    target = torch.tensor(tokens[start:], device=rows.device)
    logprobs = torch.log_softmax(rows, dim=-1)
    chosen = logprobs.gather(1, target[:, None])[:, 0]
    greedy = bool((logprobs.max(dim=-1).values <= chosen).all()) if need_greedy else False
    return Score(float(chosen.double().sum()), greedy, len(tokens) - start)


__all__ = ["HFScorer", "PeerNotRunnable", "load_peer", "score_logits", "model_bytes", "_batches"]
