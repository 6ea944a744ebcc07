"""Random-weight models with the shape of real checkpoints, written from a config alone (no download).

The engine benchmarks need a model big enough to matter on a GPU, and the hub that hosts real ones is not
reachable where we run. A forward pass costs the same whatever the weights say, so a model with the exact
shape of a real one (layers, heads, vocabulary) gives the same tokens/s figures. These models are for
throughput only: with random weights they generate noise.

No Qwen tokenizer is reachable offline either, so the directory carries smollm2-135m's tokenizer files (and
its bos/eos/pad ids). Its ids (< 49152) all fit in the larger vocabulary; the model can still sample ids
above them, which the tokenizer cannot turn into text, another reason to read only the token counts.

Torch-free at the top on purpose: `rhymerl.model.fetch` imports RANDOM_MODELS to resolve names, and
resolving a cached model must stay cheap. Torch is imported only when weights are written.
"""

from __future__ import annotations

import json
import math
import shutil
import zlib
from pathlib import Path

from rhymerl.model.config import ModelConfig

__all__ = ["RANDOM_MODELS", "RANDOM_TOKENIZER", "parameter_count", "parameter_shapes", "write_random_model_dir"]

# Qwen2.5-1.5B-Instruct's config.json (its architecture; token ids come with the tokenizer).
QWEN2_5_1_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": 32768,
    "max_window_layers": 21,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

# Built-in name -> config.json of the architecture. Another shape (say Qwen3-1.7B) is one more entry.
RANDOM_MODELS: dict[str, dict] = {
    "qwen2.5-1.5b-random": QWEN2_5_1_5B,
}

# The built-in whose tokenizer the random models borrow (the only one reachable offline).
RANDOM_TOKENIZER = "smollm2-135m"

SEED = 0
# safetensors' save_file needs a whole file's tensors in memory, so the shard size bounds peak memory.
MAX_SHARD_BYTES = 1 << 30
_TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                    "*.jinja")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def parameter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape for a config.json dict, in checkpoint order (no lm_head when tied).

    Derived from rhymerl's own Decoder (built on the meta device: no memory) through the same name mapping
    the loader uses, so what is written is exactly what `load_decoder` asks for, for any supported
    model_type (Qwen3's q/k norms and bias-free attention included)."""
    import torch

    from rhymerl.model.decoder import Decoder
    from rhymerl.model.weights import to_hf_state_dict

    with torch.device("meta"):
        model = Decoder(ModelConfig.from_hf_dict(config))
    return {name: tuple(t.shape) for name, t in to_hf_state_dict(model).items()}


def parameter_count(config: dict) -> int:
    """Number of parameters of the model a config.json dict describes (tied embeddings counted once)."""
    return sum(math.prod(shape) for shape in parameter_shapes(config).values())


def write_random_model_dir(config: dict, out: Path, tokenizer_dir: Path, seed: int = SEED,
                           max_shard_bytes: int | None = None) -> None:
    """Write a Hugging Face model directory with random bf16 weights of `config`'s shape into `out`.

    config.json is `config` plus the bos/eos/pad ids of the tokenizer copied from `tokenizer_dir`;
    generation_config.json carries the same ids. Weights are drawn tensor by tensor (normal with std
    initializer_range, norms ones, biases zeros), each from its own generator seeded by `seed` and its name,
    so the values do not depend on sharding. More than `max_shard_bytes` (default MAX_SHARD_BYTES) of
    weights are split into model-0000i-of-0000n.safetensors files with a model.safetensors.index.json, as
    transformers does."""
    out = Path(out)
    token_ids = _token_ids(Path(tokenizer_dir))
    full_config = {**config, **token_ids}
    (out / "config.json").write_text(json.dumps(full_config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(token_ids, indent=2, sort_keys=True) + "\n")
    _copy_tokenizer(Path(tokenizer_dir), out, config["max_position_embeddings"])
    _write_weights(full_config, out, seed, MAX_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes)


def _token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """The special token ids belong to the tokenizer, so they come from its model's config."""
    src = json.loads((tokenizer_dir / "config.json").read_text())
    return {k: src[k] for k in _TOKEN_IDS if src.get(k) is not None}


def _copy_tokenizer(src: Path, out: Path, max_len: int) -> None:
    for pattern in _TOKENIZER_FILES:
        for f in src.glob(pattern):
            shutil.copy2(f, out / f.name)
    # As for converted GGUFs: the tokenizer's length limit is the model's context, not the donor's.
    tok_config = out / "tokenizer_config.json"
    if tok_config.is_file():
        data = json.loads(tok_config.read_text())
        data["model_max_length"] = max_len
        tok_config.write_text(json.dumps(data, indent=2) + "\n")


def _write_weights(config: dict, out: Path, seed: int, max_shard_bytes: int) -> None:
    from safetensors.torch import save_file

    shapes = parameter_shapes(config)
    std = float(config.get("initializer_range", 0.02))
    shards = _plan_shards(shapes, max_shard_bytes, bytes_per_value=2)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    for file, shard in zip(names, shards):
        tensors = {name: _random_tensor(name, shapes[name], std, seed) for name in shard}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({name: file for name in shard})
        del tensors  # before the next shard is drawn: one shard in memory at a time
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _plan_shards(shapes: dict[str, tuple[int, ...]], max_bytes: int, bytes_per_value: int) -> list[list[str]]:
    """Consecutive tensors grouped up to max_bytes per file (a bigger tensor gets a file of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = math.prod(shape) * bytes_per_value
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _random_tensor(name: str, shape: tuple[int, ...], std: float, seed: int):
    import torch

    # Ones and zeros where a freshly initialised transformers model has them, so activations keep a sane
    # scale through the layers (random norm weights would only add noise to noise).
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if "norm" in name:
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=g, dtype=torch.float32) * std).to(torch.bfloat16)
