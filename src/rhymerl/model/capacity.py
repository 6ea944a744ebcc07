"""Whether a context fits a model and the machine, checked before anything is allocated.

An engine preallocates its KV cache for `num_slots` sequences of `max_model_len` tokens: asked for a context
of 100M tokens it would die in the allocator with a traceback about terabytes. `check_context` refuses such a
request first, naming the key the user set and the memory it would need, and refuses a context longer than
the model's own (`max_position_embeddings` in config.json), where the model was never trained to attend.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rhymerl.errors import UserError
from rhymerl.model.config import ModelConfig

__all__ = ["ContextError", "available_memory", "check_context", "kv_cache_bytes"]

_GIB = 1 << 30


class ContextError(UserError):
    """A context that the model cannot attend over, or whose KV cache cannot fit in memory."""


def kv_cache_bytes(cfg: ModelConfig, num_slots: int, max_model_len: int, dtype: torch.dtype, scratch: int = 0) -> int:
    """Bytes of the engine's KV cache (`rhymerl.engine.kv_cache.KVCache`'s layout)."""
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    return per_token * num_slots * (max_model_len + scratch)


def available_memory(device: str | torch.device) -> int | None:
    """Bytes free for new tensors on `device`: a GPU's free memory, or the host's MemAvailable (Linux;
    None where it cannot be read)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_context(model_dir: str | os.PathLike, *, max_model_len: int, num_slots: int, dtype: torch.dtype,
                  device: str | torch.device, key: str, slots_key: str, scratch: int = 0) -> None:
    """Raise ContextError unless `max_model_len` tokens fit the model's context (config.json's
    max_position_embeddings) and a KV cache of `num_slots` x `max_model_len` tokens fits the memory free on
    `device`. `key` and `slots_key` name what the user set (a config key, or an option with its value, e.g.
    "data.max_prompt_length (256) + rollout.max_completion_length (128)"), for the message."""
    cfg = ModelConfig.from_dir(model_dir)
    if max_model_len > cfg.max_position_embeddings:
        raise ContextError(f"{key} = {max_model_len} tokens per sequence exceeds the model's context of "
                           f"{cfg.max_position_embeddings} tokens (max_position_embeddings in "
                           f"{Path(model_dir) / 'config.json'}): lower it")
    need = kv_cache_bytes(cfg, num_slots, max_model_len, dtype, scratch)
    free = available_memory(device)
    if free is not None and need > free:
        raise ContextError(f"{key} = {max_model_len} tokens x {slots_key} = {num_slots} slots needs "
                           f"{need / _GIB:.1f} GiB of KV cache ({str(dtype).removeprefix('torch.')}), "
                           f"{free / _GIB:.1f} GiB is free on {torch.device(device).type}: lower either")
