"""Transformers' own decoder layers, one at a time, with their tensors streamed from a Checkpoint.

The whole model is built once on the meta device (no memory); `load(i)` gives decoder layer i
real float32 tensors read one by one from the checkpoint (on `device`: the CPU, or a GPU,
where calibration is many times faster), `release(i)` sends them back to
meta. `run(layer, x)` calls the layer as the HF model does: RoPE (cos, sin) from the model's
own rotary embedding at positions 0..T-1, and an explicit causal mask.
"""

import copy

import torch

from eightbit.quant.errors import QuantizeError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def already_quantized(path, why: str) -> QuantizeError:
    return QuantizeError(f"{path} is already quantized ({why}); pass the float checkpoint it came from")


def check_source(checkpoint) -> None:
    """Raise QuantizeError unless the checkpoint is a float model of a family eightbit quantizes."""
    check_float(checkpoint, config_only=True)
    check_supported(checkpoint.config)
    check_float(checkpoint)


def check_float(checkpoint, config_only: bool = False) -> None:
    """Raise QuantizeError if the checkpoint is already quantized: its config says so, or (unless config_only)
    its first Linear weight is an integer tensor."""
    qc = getattr(checkpoint.config, "quantization_config", None)
    if qc:
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        raise already_quantized(checkpoint.source, f"its config has a quantization_config, quant_method {method!r}")
    name = "model.layers.0.self_attn.q_proj.weight"  # one Linear tells: they are quantized alike
    if not config_only and name in checkpoint.tensor_names():
        dtype = checkpoint.get_tensor(name).dtype
        if not dtype.is_floating_point or dtype.itemsize == 1:  # int8, or FP8 (with scales of its own)
            raise already_quantized(checkpoint.source, f"tensor {name!r} is {dtype}")


def check_supported(config) -> None:
    """Raise QuantizeError unless the config is a Llama-architecture model the engine runs (the engine's own
    checks, RoPE scaling included: a checkpoint it would refuse is not written)."""
    from eightbit.engine.models.llama import check_supported as engine_check_supported

    mt = getattr(config, "model_type", None)
    if mt not in ARCHITECTURES:
        raise QuantizeError(
            f"unsupported model type {mt!r}: eightbit quantizes the Llama family ({', '.join(ARCHITECTURES)})"
        )
    try:
        engine_check_supported(config)
    except ValueError as e:
        raise QuantizeError(str(e)) from None
    arch = getattr(config, "architectures", None) or []
    if arch and arch[0] != ARCHITECTURES[mt]:
        raise QuantizeError(f"unsupported architecture {arch[0]!r} for model type {mt!r}")


def architecture(config) -> str:
    return ARCHITECTURES[config.model_type]


class DecoderLayers:
    def __init__(self, checkpoint, device="cpu"):
        from transformers import AutoModelForCausalLM

        check_source(checkpoint)
        self.checkpoint = checkpoint
        self.device = torch.device(device)
        config = copy.deepcopy(checkpoint.config)
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        self.config = self.model.config
        self.layers = self.model.model.layers
        rotary_cls = type(self.model.model.rotary_emb)
        self.rotary = rotary_cls(config=self.config)  # on the CPU: its buffers are computed, not loaded
        self._rope = {}
        have = set(checkpoint.tensor_names())
        self._check_tensor_names(have)
        self._check_outer_tensors(have)

    def _check_tensor_names(self, have: set) -> None:
        """Every tensor the config implies is in the checkpoint and every tensor in it is one the config implies,
        before any layer is calibrated: a tensor the model would not read (a bias the config says is absent,
        FP8 scales) would be dropped silently and the output be wrong."""
        want = set(self.model.state_dict())
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        optional = {"lm_head.weight"} if tied else set()
        missing = sorted(want - have - optional)
        if missing:
            raise QuantizeError(f"the checkpoint has no tensor {missing[0]!r}"
                                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        extra = sorted(n for n in have - want if not n.endswith("rotary_emb.inv_freq"))
        if extra:
            raise QuantizeError(f"the checkpoint has tensors its config does not use, e.g. {extra[:3]} "
                                f"({len(extra)} in all): a bias the config says is absent, or quantization scales? "
                                "Quantizing would drop them")

    def _check_outer_tensors(self, have: set) -> None:
        """The embedding, final norm and lm_head: their shapes and values checked before any layer is calibrated
        (a wrong shape was written and then refused by the engine; NaN in lm_head was found after the last layer)."""
        for name, p in self.model.state_dict().items():
            if name.startswith("model.layers.") or name not in have:
                continue
            t = self.checkpoint.get_tensor(name)
            if tuple(t.shape) != tuple(p.shape):
                raise QuantizeError(f"tensor {name!r} has shape {tuple(t.shape)}, the config implies {tuple(p.shape)}")
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise QuantizeError(f"tensor {name!r} holds NaN or inf values")

    def __len__(self):
        return len(self.layers)

    def prefix(self, i: int) -> str:
        return f"model.layers.{i}."

    def load(self, i: int) -> torch.nn.Module:
        """Decoder layer i with float32 tensors from the checkpoint (NaN/inf is a QuantizeError)."""
        layer = self.layers[i]
        state = {}
        for name, p in layer.named_parameters():
            full = self.prefix(i) + name
            try:
                t = self.checkpoint.get_tensor(full)
            except KeyError as e:
                raise QuantizeError(f"the checkpoint has no tensor {full!r}") from e
            if not t.is_floating_point():  # int8 read as float32 would be garbage
                raise already_quantized(self.checkpoint.source, f"tensor {full!r} is {t.dtype}")
            if tuple(t.shape) != tuple(p.shape):
                raise QuantizeError(f"tensor {full!r} has shape {tuple(t.shape)}, the config implies {tuple(p.shape)}")
            # a copy: checkpoint tensors may be copy-on-write views of an mmapped file, and
            # folding in place would leave dirty private pages mapped until the file is closed
            t = t.to(self.device, torch.float32, copy=True)
            if not torch.isfinite(t).all():
                raise QuantizeError(f"tensor {full!r} holds NaN or inf values")
            state[name] = t
        layer.load_state_dict(state, strict=True, assign=True)
        layer.eval()
        return layer

    def release(self, i: int) -> None:
        self.layers[i].to("meta")

    def _rope_for(self, t: int):
        if t not in self._rope:
            pos = torch.arange(t).unsqueeze(0)
            cos, sin = self.rotary(torch.zeros(1, dtype=torch.float32), pos)
            mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1).view(1, 1, t, t)
            dev = self.device
            self._rope = {t: (pos.to(dev), (cos.to(dev), sin.to(dev)), mask.to(dev))}
        return self._rope[t]

    @torch.no_grad()
    def run(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] float32 -> the layer's output [B, T, H]."""
        pos, rope, mask = self._rope_for(x.shape[1])
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        return out[0] if isinstance(out, tuple) else out
