"""What a Hugging Face model directory must hold, checked before it is used.

A config.json that is empty, not JSON or not a supported architecture, or safetensors weights that are
truncated or not safetensors at all, raise ModelFileError naming the file and what to do, rather than a
parser's traceback when the weights load. Headers only: cheap enough to run on every resolve.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from rhymerl.errors import UserError
from rhymerl.model.config import ModelConfig

__all__ = ["ModelFileError", "check_model_dir"]


class ModelFileError(UserError):
    """A model directory's config.json or weights cannot be read (the message names the file)."""


# A safetensors file: an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
# data_offsets: [begin, end]}, "__metadata__": {...}}, then the data; offsets count from the data's start.
_MAX_HEADER = 100 << 20  # the format's own limit on the header


def check_model_dir(model_dir: str | os.PathLike) -> ModelConfig:
    """Check a Hugging Face model directory without loading its weights (headers only, cheap) and return its
    architecture: config.json a JSON object of a supported model (`ModelConfig`), and every safetensors file
    (those of model.safetensors.index.json when there is one) whole. Raises ModelFileError naming the file
    and what to do. A directory without weights passes: loading it says so."""
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except OSError as e:
        raise ModelFileError(f"{config}: cannot read the model's config ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        what = "empty" if not config.read_bytes().strip() else f"not valid JSON ({e})"
        raise ModelFileError(f"{config}: {what}; the model directory {model_dir} needs the Hugging Face "
                             f"config.json its weights were saved with") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{config}: expected a JSON object, got {type(data).__name__}")
    try:
        cfg = ModelConfig.from_hf_dict(data)
    except KeyError as e:
        raise ModelFileError(f"{config}: field {e.args[0]!r} missing; is this a Llama-family config.json?") from None
    except (ValueError, TypeError) as e:
        raise ModelFileError(f"{config}: {e}") from None
    for f in _weight_files(model_dir):
        _check_safetensors(f)
    return cfg


def _weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files the loader reads (none here is reported by the loader, naming the directory)."""
    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        return sorted(model_dir.glob("*.safetensors"))
    try:
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ModelFileError(f"{index}: not a safetensors index with a 'weight_map' "
                             f"({type(e).__name__}: {e})") from None
    return [model_dir / str(shard) for shard in shards]


def _check_safetensors(path: Path) -> None:
    """The header of a safetensors file parses and the data it describes is all there."""
    advice = "download or copy the model again"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= n <= min(_MAX_HEADER, size - 8):
                raise ModelFileError(f"{path}: not a safetensors file, or truncated (its {size} bytes hold no "
                                     f"valid header): {advice}")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ModelFileError(f"{path}: not a safetensors file (its header is not JSON): {advice}") from None
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (AttributeError, TypeError, KeyError, IndexError, ValueError):
        raise ModelFileError(f"{path}: not a safetensors file (malformed header): {advice}") from None
    if 8 + n + end != size:
        raise ModelFileError(f"{path}: truncated or padded: its header describes {8 + n + end} bytes, the file "
                             f"has {size}: {advice}")
