"""The architecture of a Llama-family checkpoint, read from a Hugging Face `config.json`.

Torch-free on purpose: the engine's data structures and the trainer's config code read it without
importing torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# model_type -> (qkv bias, per-head q/k RMSNorm). Every other Llama-family difference is in the
# config values themselves (GQA head counts, head_dim, rope, tied embeddings).
SUPPORTED_ARCHITECTURES = {
    "llama": (False, False),  # Llama 2/3, SmolLM/SmolLM2
    "qwen2": (True, False),  # Qwen2 / Qwen2.5: bias on q, k, v
    "qwen3": (False, True),  # Qwen3: RMSNorm on each head of q and k before rope
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: dict = field(default_factory=dict)  # {} = plain rope; "llama3" and "linear" supported
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r}: rhymerl's decoder implements "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[model_type]
        qkv_bias = bool(cfg.get("attention_bias", qkv_bias))
        num_heads = cfg["num_attention_heads"]
        # transformers 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        if not rope:
            rope = dict(cfg.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = {} if rope_type == "default" else {**rope, "rope_type": rope_type}
        if rope_scaling and rope_type not in ("llama3", "linear"):
            raise ValueError(f"unsupported rope_type {rope_type!r}: supported are default, linear, llama3")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            rope_scaling=rope_scaling,
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        try:
            return cls.from_hf_dict(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"cannot read model config {path}: {e!r}") from e
