"""One call from a model name or path to (decoder, tokenizer): what the CLI, benchmarks and trainer use."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from rhymerl.errors import UserError
from rhymerl.model.decoder import Decoder
from rhymerl.model.device import onednn_bf16
from rhymerl.model.fetch import resolve_model_dir
from rhymerl.model.weights import load_decoder

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def has_fast_bf16(device: str | torch.device) -> bool:
    """Whether bf16 matmuls run natively on `device`: a CUDA GPU that supports bf16, or a CPU for which oneDNN
    has bf16 kernels (`onednn_bf16`). Elsewhere (an AVX2-only x86 such as AMD Zen 3) torch
    falls back to a generic bf16 matmul, several times slower than fp32 (docs/notebook, bench engine
    at 733015d)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    return onednn_bf16()


def resolve_dtype(name: str, device: str | torch.device) -> str:
    """The dtype `name` stands for on `device`: "auto" is "bf16" where bf16 matmuls are native
    (`has_fast_bf16`), else "fp32"; any other name is returned as it is."""
    if name != "auto":
        return name
    return "bf16" if has_fast_bf16(device) else "fp32"


def parse_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype of `name` (see DTYPES; "auto" as `resolve_dtype` decides for `device`)."""
    name = resolve_dtype(name, device)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {sorted(DTYPES) + ['auto']}")
    return DTYPES[name]


def load_pretrained(name_or_path: str, dtype: str = "auto", device: str | None = None) -> tuple[Decoder, object, Path]:
    """(decoder in eval mode, its Hugging Face tokenizer, the resolved model directory)."""
    model_dir = resolve_model_dir(name_or_path)
    device = device or default_device()
    model = load_decoder(model_dir, parse_dtype(dtype, device), device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model, tokenizer, model_dir


def chat_prompt_ids(tokenizer, prompt: str | list[dict]) -> list[int]:
    """Token ids of a prompt with the chat template and the assistant's generation prompt: a text becomes
    one user turn, a list of {role, content} messages is used as is. Without a chat template, a text is
    encoded plainly."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    raise UserError(f"{tokenizer.name_or_path}: the tokenizer has no chat template (chat_template.jinja, or "
                    f"'chat_template' in tokenizer_config.json), and chat messages need one: use a chat model")
