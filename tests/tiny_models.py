"""Tiny random-weight checkpoints of each supported architecture, written as Hugging Face directories."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from rhymerl.model.weights import load_decoder

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": False}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 24, "tie_word_embeddings": False}),
    # heads of 64 (SmolLM2's size), which the fused decode attention takes (it leaves 16 and 24 to SDPA)
    "llama-d64": (LlamaConfig, LlamaForCausalLM, {"head_dim": 64, "tie_word_embeddings": True}),
}
VOCAB = 96


@functools.lru_cache(maxsize=None)
def tiny_checkpoint(arch: str = "llama") -> tuple[str, torch.nn.Module]:
    """(directory, transformers model) for a 2-layer GQA model with random weights (biases and norms too,
    so that every parameter matters in a comparison)."""
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(1234)
    cfg = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     eos_token_id=None, **extra)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = tempfile.mkdtemp(prefix=f"rhymerl-tiny-{arch}-")
    atexit.register(shutil.rmtree, path, True)  # cached for the whole test session, removed when it ends
    model.save_pretrained(path)
    return path, model


def tiny_decoder(arch: str = "llama", dtype: torch.dtype = torch.float32):
    return load_decoder(tiny_checkpoint(arch)[0], dtype)


def random_prompts(n: int, lo: int = 2, hi: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lengths]
