"""Hugging Face checkpoint names <-> the decoder's fused parameters.

The decoder fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; these functions concatenate on
load and split on export, so checkpoints stay loadable by transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from rhymerl.model.config import ModelConfig
from rhymerl.model.decoder import Decoder, rope_inv_freq
from rhymerl.model.directory import ModelFileError

# Weights that do not fit config.json are bad input (ModelFileError: one line from the command line), not a bug.
_ADVICE = "copy or download the model directory again, config.json together with its weights"

# Parts of a fused parameter, in the order they are concatenated along dim 0.
_FUSED = {
    "self_attn.qkv_proj.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "self_attn.qkv_proj.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
}


def _hf_names(our_name: str) -> list[str]:
    """Our parameter name -> the Hugging Face tensor names it is made of."""
    if our_name.startswith("layers."):
        _, idx, rest = our_name.split(".", 2)
        parts = _FUSED.get(rest, [rest])
        return [f"model.layers.{idx}.{p}" for p in parts]
    if our_name.startswith("lm_head."):
        return [our_name]
    return [f"model.{our_name}"]


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def load_decoder(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Decoder:
    """Build a Decoder from a Hugging Face directory (config.json + safetensors)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = Decoder(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                tensors[name] = st.get_tensor(name)
    state = {}
    for name, param in model.named_parameters():
        parts = _hf_names(name)
        missing = [p for p in parts if p not in tensors]
        if missing:
            raise ModelFileError(f"{model_dir / 'config.json'} does not match the weights beside it: they lack "
                                 f"{', '.join(missing)} (for {name}); {_ADVICE}")
        t = torch.cat([tensors[p] for p in parts], dim=0) if len(parts) > 1 else tensors[parts[0]]
        if t.shape != param.shape:
            raise ModelFileError(f"{model_dir / 'config.json'} does not match the weights beside it: "
                                 f"{', '.join(parts)} has shape {tuple(t.shape)}, the config makes it "
                                 f"{tuple(param.shape)}; {_ADVICE}")
        state[name] = t.to(dtype)
    # strict=False only because a tied lm_head.weight is not a separate tensor; every parameter was
    # checked above.
    model.load_state_dict(state, assign=True, strict=False)
    model.tie_weights()
    # The module was built on the meta device (no memory spent on random init); the non-persistent
    # rope buffer is not in the checkpoint, so compute it for real here.
    model.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
    return model.to(device).eval()


def to_hf_state_dict(model: Decoder, params: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The decoder's weights under Hugging Face names (fused parameters split back). `params` (Decoder names)
    replaces the model's own parameters, e.g. with LoRA-merged weights."""
    cfg = model.cfg
    sizes = {
        "self_attn.qkv_proj": [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim],
        "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
    }
    out = {}
    for name, param in (params if params is not None else dict(model.named_parameters())).items():
        parts = _hf_names(name)
        if len(parts) == 1:
            out[parts[0]] = param.detach().contiguous()
            continue
        key = name.split(".", 2)[2].rsplit(".", 1)[0]
        for part, chunk in zip(parts, param.detach().split(sizes[key], dim=0)):
            out[part] = chunk.contiguous()
    return out
