"""The peers, measured the way their users run them: HF transformers `generate` on the same shapes.

Systems:
- `hf-bf16`: LlamaForCausalLM in bf16, eager, dynamic cache (SDPA attention);
- `hf-bf16-compile`: the same with `cache_implementation="static"`, which makes `generate` compile
  the decode step itself (we never wrap forward in torch.compile: see /work/shared/GPU_NOTES.md);
- `hf-bnb-int8`: bitsandbytes LLM.int8 (`Linear8bitLt`, threshold 6.0) on every decoder linear, lm_head
  left bf16 (HF's default skip), eager; its per-call "cast to float16" warning is silenced;
- `hf-torchao-int8`: torchao `Int8DynamicActivationInt8WeightConfig` on every decoder linear, eager;
- `hf-torchao-int8-compile`: the same with the static cache (compiled; 200+ s of warm-up, and batch
  <= 16 fails in `torch._int_mm`: the error is recorded).

Models are random-weight `LlamaForCausalLM(LlamaConfig(**KNOWN_SHAPES[model]))` built on the device in
bf16 with N(0, 0.02) weights and no EOS token (so every row generates exactly `max_new_tokens`).

Throughput is static batching: the requests in list order, `batch` at a time, left-padded to the
batch's longest prompt, each batch generating its longest output; only each request's own output
length counts (the padding steps of shorter requests are waste the system really pays). Latency:
TTFT = `generate(max_new_tokens=1)`; TPOT = (time of `new_tokens` - TTFT) / (new_tokens - 1).
"""

import time
import warnings

import torch

from eightbit.eval.bench_common import (
    decode_step_bytes,
    hf_kv_bytes_per_token,
    random_prompts,
    short_error,
    weight_bytes,
)
from eightbit.eval.bench_engine import Deadline
from eightbit.eval.peers import quiet_bitsandbytes

PEER_SYSTEMS = {
    "hf-bf16": dict(quant=None, static=False),
    "hf-bf16-compile": dict(quant=None, static=True),
    "hf-bnb-int8": dict(quant="bnb", static=False),
    "hf-torchao-int8": dict(quant="torchao", static=False),
    "hf-torchao-int8-compile": dict(quant="torchao", static=True),
}


def _quiet():
    warnings.filterwarnings("ignore", message=r".*cast.*float16.*")
    warnings.filterwarnings("ignore", message=r".*MatMul8bitLt.*")
    warnings.filterwarnings("ignore", module=r"bitsandbytes.*")
    quiet_bitsandbytes()
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except Exception:
        pass
    try:
        import torch._dynamo

        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, name):  # batch sizes x cache lengths: more than 8 variants
                setattr(torch._dynamo.config, name, max(256, getattr(torch._dynamo.config, name)))
    except Exception:
        pass


def build_hf_model(model, device, seed=0, dtype=torch.bfloat16):
    """A random-weight HF Llama of a KNOWN_SHAPES shape, on `device`, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eightbit.engine.dummy import KNOWN_SHAPES

    if model not in KNOWN_SHAPES:
        raise ValueError(f"unknown model shape {model!r}; known: {sorted(KNOWN_SHAPES)}")
    config = LlamaConfig(**KNOWN_SHAPES[model], bos_token_id=None, eos_token_id=None, pad_token_id=0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            m = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
    m.generation_config.eos_token_id = None
    m.generation_config.bos_token_id = None
    m.generation_config.pad_token_id = 0
    return m.eval()


def _decoder_linears(m):
    for name, module in m.named_modules():
        if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
            yield name, module


def quantize_bnb_int8(m, threshold=6.0):
    """Swap every decoder nn.Linear for bitsandbytes' Linear8bitLt (LLM.int8, inference mode)."""
    import bitsandbytes as bnb

    device = next(m.parameters()).device
    for name, lin in list(_decoder_linears(m)):
        parent_name, _, leaf = name.rpartition(".")
        parent = m.get_submodule(parent_name)
        q = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                has_fp16_weights=False, threshold=threshold, device="meta")
        # Int8Params quantizes when moved from the CPU to the target device
        weight = lin.weight.data.to("cpu", torch.float16)
        q.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        if lin.bias is not None:
            q.bias = torch.nn.Parameter(lin.bias.data.clone(), requires_grad=False)
        q = q.to(device)
        if q.weight.dtype != torch.int8:
            raise RuntimeError(f"bitsandbytes did not quantize {name} (weight is {q.weight.dtype})")
        setattr(parent, leaf, q)
        del lin
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return m


def quantize_torchao_int8(m):
    """torchao int8 dynamic activation + int8 per-channel weight on every decoder linear."""
    from torchao.quantization import quantize_

    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig as Config
    except ImportError:  # older torchao
        from torchao.quantization import int8_dynamic_activation_int8_weight as Config
    quantize_(m, Config(), filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and "lm_head" not in fqn)
    return m


def _deadline_stop(deadline):
    """A StoppingCriteria that ends generate() at the deadline (all rows at once); `.fired` tells."""
    from transformers import StoppingCriteria

    class DeadlineStop(StoppingCriteria):
        fired = False

        def __call__(self, input_ids, scores, **kwargs):
            stop = deadline.passed()
            self.fired |= stop
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    return DeadlineStop()


class HFSystem:
    def __init__(self, name, model, device="cuda", seed=0):
        if name not in PEER_SYSTEMS:
            raise ValueError(f"unknown peer {name!r}; known: {sorted(PEER_SYSTEMS)}")
        _quiet()
        self.name, self.model_name, self.device = name, model, torch.device(device)
        spec = PEER_SYSTEMS[name]
        self.static = spec["static"]
        self.model = build_hf_model(model, self.device, seed)
        if spec["quant"] == "bnb":
            quantize_bnb_int8(self.model)
        elif spec["quant"] == "torchao":
            quantize_torchao_int8(self.model)
        self.config = self.model.config
        self.vocab_size = self.config.vocab_size
        self.weights = weight_bytes(self.model)
        self.kv_bytes_per_token = hf_kv_bytes_per_token(self.config)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def generate(self, prompts, max_new_tokens, cache_len=None, deadline=None):
        """Left-padded batched greedy generate; returns (tokens generated per row, seconds, stopped early)."""
        from transformers import StoppingCriteriaList

        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(list(p))
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=None)
        if self.static:
            kwargs["cache_implementation"] = "static"
            # one static cache length for every call of this shape, so the compiled step is reused
            self.model._previous_max_cache_length = cache_len or width + max_new_tokens
        stop = None
        if deadline is not None and deadline.end is not None:
            stop = _deadline_stop(deadline)
            kwargs["stopping_criteria"] = StoppingCriteriaList([stop])
        self._sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, **kwargs)
        self._sync()
        seconds = time.perf_counter() - t0
        return out.shape[1] - width, seconds, bool(stop and stop.fired)

    # --- latency ---------------------------------------------------------------------

    def bench_latency(self, batch_sizes=(1, 64), prompt_len=512, new_tokens=128, seed=0, deadline=None,
                      copy_gbs=None, warmup=True, base=None):
        deadline = deadline or Deadline()
        records = []
        for batch in batch_sizes:
            rec = dict(base or {}, bench="latency", batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                       weights=self.weights, kv_bytes_per_token=self.kv_bytes_per_token, ok=False, error=None)
            try:
                if deadline.passed():
                    raise TimeoutError("skipped: the time cap was reached before this batch size")
                cache_len = prompt_len + new_tokens
                if warmup:  # compiles (static cache) at this batch and cache length
                    self.generate(random_prompts(batch, prompt_len, self.vocab_size, seed + 7919 + batch),
                                  min(4, new_tokens), cache_len)
                prompts = random_prompts(batch, prompt_len, self.vocab_size, seed + batch)
                _, ttft, _ = self.generate(prompts, 1, cache_len)
                n, total, stopped = self.generate(prompts, new_tokens, cache_len, deadline)
                decode_time = total - ttft
                contexts = [[prompt_len + i] * batch for i in range(1, n)]  # decode step i attends prompt + i
                decode_bytes = sum(decode_step_bytes(self.weights, self.kv_bytes_per_token, c) for c in contexts)
                rec.update(
                    ttft_ms=1e3 * ttft,
                    ttft_ms_max=1e3 * ttft,  # one prefill gives every row its first token at once
                    tpot_ms=1e3 * decode_time / (n - 1) if n > 1 else None,
                    tok_s=batch * n / total,
                    decode_tok_s=batch * (n - 1) / decode_time if n > 1 and decode_time > 0 else None,
                    bytes_per_token=decode_bytes / (batch * (n - 1)) if n > 1 else None,
                    achieved_gbs=decode_bytes / decode_time / 1e9 if n > 1 and decode_time > 0 else None,
                    elapsed_s=total, generated_tokens=batch * n, decode_steps=n - 1, copy_gbs=copy_gbs,
                    partial=stopped,
                )
                rec["roofline_pct"] = (100.0 * rec["achieved_gbs"] / copy_gbs
                                       if copy_gbs and rec["achieved_gbs"] is not None else None)
                if stopped:
                    rec["note"] = f"stopped at the time cap after {n} of {new_tokens} tokens"
                rec["ok"] = True
            except Exception as e:
                rec["error"] = short_error(e)
            records.append(rec)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return records

    # --- throughput ------------------------------------------------------------------

    def throughput_at_batch(self, requests, batch, deadline=None, warmup=True):
        """Static batches of `batch` over `requests`; real tokens only. Returns a per-batch-size dict."""
        deadline = deadline or Deadline()
        cache_len = max(len(r.prompt) for r in requests) + max(r.output_len for r in requests)
        if warmup:
            chunk = requests[:batch]
            self.generate([r.prompt for r in chunk], min(4, max(r.output_len for r in chunk)), cache_len)
        real = generated = 0
        seconds = 0.0
        done = 0
        stopped = False
        for start in range(0, len(requests), batch):
            if deadline.passed():
                stopped = True
                break
            chunk = requests[start:start + batch]
            n, t, fired = self.generate([r.prompt for r in chunk], max(r.output_len for r in chunk), cache_len,
                                        deadline)
            real += sum(min(r.output_len, n) for r in chunk)
            generated += n * len(chunk)
            seconds += t
            if fired:
                stopped = True
                break
            done += len(chunk)
        return dict(batch=batch, real_output_tokens=real, padded_output_tokens=generated, elapsed_s=seconds,
                    output_tok_s=real / seconds if seconds > 0 else None, finished_requests=done,
                    partial=stopped or done < len(requests))

    def bench_throughput(self, requests, batch_sizes=(64, 32), deadline=None, warmup=True, base=None,
                         num_requests_total=None):
        deadline = deadline or Deadline()
        rec = dict(base or {}, bench="throughput", num_requests=len(requests),
                   num_requests_total=num_requests_total or len(requests), per_batch={}, ok=False, error=None,
                   partial=False)
        errors = []
        for batch in batch_sizes:
            if deadline.passed():
                rec["per_batch"][str(batch)] = dict(batch=batch, error="skipped: time cap")
                continue
            try:
                rec["per_batch"][str(batch)] = self.throughput_at_batch(requests, batch, deadline, warmup)
            except Exception as e:
                errors.append(f"batch {batch}: {short_error(e)}")
                rec["per_batch"][str(batch)] = dict(batch=batch, error=short_error(e))
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        done = [v for v in rec["per_batch"].values() if v.get("output_tok_s")]
        complete = [v for v in done if not v["partial"]]
        if done:
            best = max(complete or done, key=lambda v: v["output_tok_s"])  # a full run beats a partial one
            rec.update(batch_size=best["batch"], output_tok_s=best["output_tok_s"], elapsed_s=best["elapsed_s"],
                       output_tokens=best["real_output_tokens"], padded_output_tokens=best["padded_output_tokens"],
                       finished_requests=best["finished_requests"], partial=best["partial"], ok=True)
            if best["partial"]:
                rec["note"] = (f"stopped at the time cap: {best['finished_requests']} of {len(requests)} requests "
                               "finished; tok/s over the steps run until then (favours the peer: no tail)")
        if errors:
            rec["error"] = "; ".join(errors)
        elif not done:
            rec["error"] = "no batch size finished within the time cap"
        return rec
