"""Tiny random-weight checkpoints of each supported architecture, written as Hugging Face directories."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from rhymerl.model.weights import load_decoder

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": False}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 24, "tie_word_embeddings": False}),
    # heads of 64 (SmolLM2's size), which the fused decode attention takes (it leaves 16 and 24 to SDPA)
    "llama-d64": (LlamaConfig, LlamaForCausalLM, {"head_dim": 64, "tie_word_embeddings": True}),
}
VOCAB = 96
CHAT = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # a plain chat template: the messages' texts


def byte_model_dir(path: Path, max_positions: int) -> Path:
    """A 2-layer random Llama with a byte-level BPE tokenizer (no merges: one token a byte) and a plain chat
    template, written to `path`: a model directory the CLI and the benchmarks load offline."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", chat_template=CHAT).save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      tie_word_embeddings=True, eos_token_id=vocab["<eos>"], bos_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


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


def tiny_smol_checkpoint(path: Path, smollm2_dir: Path, embed_std: float) -> Path:
    """Write into `path` a 2-layer random Llama with the real SmolLM2 tokenizer and chat template (for the
    training-loop tests, which need a chat template). `embed_std` sets how peaked its logits are: 0.8 gives
    ~0.5 nats, responses that vary within a group yet repeat across epochs (HistoSpec drafts from history);
    0.3 flatter ones, siblings that differ more."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    model.model.embed_tokens.weight.data.normal_(0, embed_std)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, path / name)
    return path


def peaky_checkpoint(path: Path) -> str:
    """Copy the tiny llama into `path` with its final norm scaled 6x: peaky logits, so that history drafts get
    accepted (see tests/histospec)."""
    shutil.copytree(tiny_checkpoint("llama")[0], path, dirs_exist_ok=True)
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"] *= 6.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def stopping_checkpoint(path: Path, eos: tuple[int, ...] = (3, 17, 40, 77)) -> str:
    """Copy the tiny llama into `path` with `eos` as its end-of-sequence tokens: a random model draws one of
    them now and then, so that responses end at lengths from 1 to past 40 (without, every response runs to
    max_tokens and nothing is left for a length-aware schedule to order)."""
    shutil.copytree(tiny_checkpoint("llama")[0], path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"eos_token_id": list(eos)}))
    return str(path)
