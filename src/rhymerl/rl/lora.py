"""LoRA through peft on our own Decoder (model.lora_r > 0): fewer trainable weights and a much smaller
optimizer state, which is what makes fine-tuning cheap on a CPU.

peft injects its adapters into any nn.Module whose target layers are nn.Linear (ours subclass it), so the
Decoder keeps its forward; the rollout engine keeps a plain Decoder and receives merged weights
W + (alpha / r) B A at each sync, and checkpoints hold the merged model so transformers can load it.
"""

from __future__ import annotations

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer

from rhymerl.model.decoder import Decoder

TARGET_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def add_lora(model: Decoder, r: int, alpha: int, dropout: float) -> Decoder:
    """Inject LoRA adapters (rank r) into every projection of every layer and freeze everything else."""
    inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=TARGET_MODULES),
                            model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def merged_parameters(model: Decoder) -> dict[str, torch.Tensor]:
    """The model's parameters under plain Decoder names, each LoRA layer's delta merged into its weight
    (for a model without LoRA: its parameters as they are). Detached; no copy where nothing is merged."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = p.detach()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):
                key = f"{name}.weight"
                out[key] = out[key] + module.get_delta_weight("default")
    return out
