"""One call from a model name or path to (decoder, tokenizer): what the CLI, benchmarks and trainer use."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from rhymerl.model.decoder import Decoder
from rhymerl.model.fetch import resolve_model_dir
from rhymerl.model.weights import load_decoder

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_pretrained(name_or_path: str, dtype: str = "bf16", device: str | None = None) -> tuple[Decoder, object, Path]:
    """(decoder in eval mode, its Hugging Face tokenizer, the resolved model directory)."""
    model_dir = resolve_model_dir(name_or_path)
    model = load_decoder(model_dir, parse_dtype(dtype), device or default_device())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model, tokenizer, model_dir


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a single user turn with the chat template and the assistant's generation prompt
    (plain encoding when the tokenizer has no chat template)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer.encode(text)
