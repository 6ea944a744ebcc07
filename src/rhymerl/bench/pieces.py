"""A file carried in pieces: split it into parts of at most N MiB with a manifest of checksums, and join
them back, checked, on the other side. `scripts/gpu_check.sh` brings the model to a lent GPU this way (its
tool carries at most 64 MiB a call).

    python -m rhymerl.bench.pieces split FILE DIR [--max-mib 48]   # DIR/NAME.partNNN, DIR/NAME.manifest.json
    python -m rhymerl.bench.pieces join MANIFEST OUT                 # OUT, its sha256 checked

Torch-free: the other side may have nothing but Python.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

MAX_MIB = 48
_CHUNK = 1 << 20


class PiecesError(Exception):
    """A piece or the whole is missing, or its checksum is not the manifest's."""


def split(path: Path, out_dir: Path, max_mib: int = MAX_MIB) -> Path:
    """Write `path` into `out_dir` as NAME.part000, NAME.part001, ... of at most `max_mib` MiB each, and
    NAME.manifest.json (the name, size and sha256 of the whole and of each part); returns the manifest."""
    if max_mib < 1:
        raise ValueError(f"max_mib must be at least 1, got {max_mib}")
    out_dir.mkdir(parents=True, exist_ok=True)
    limit, whole, parts = max_mib << 20, hashlib.sha256(), []
    with open(path, "rb") as src:
        while True:
            data = src.read(limit)
            if not data and parts:
                break
            name = f"{path.name}.part{len(parts):03d}"
            (out_dir / name).write_bytes(data)
            whole.update(data)
            parts.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
            if len(data) < limit:
                break
    manifest = out_dir / f"{path.name}.manifest.json"
    manifest.write_text(json.dumps({"name": path.name, "size": sum(p["size"] for p in parts),
                                    "sha256": whole.hexdigest(), "parts": parts}, indent=1) + "\n")
    return manifest


def join(manifest: Path, out: Path) -> Path:
    """Reassemble the file that `manifest` describes (its parts beside it) into `out`, checking every part
    and the whole against the manifest's sha256; `out` appears only once it is whole and checked."""
    spec = json.loads(manifest.read_text())
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    whole = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for part in spec["parts"]:
                path = manifest.parent / part["name"]
                if not path.is_file():
                    raise PiecesError(f"{manifest}: part {part['name']} is missing")
                digest = hashlib.sha256()
                with open(path, "rb") as src:
                    while data := src.read(_CHUNK):
                        digest.update(data)
                        whole.update(data)
                        dst.write(data)
                if digest.hexdigest() != part["sha256"]:
                    raise PiecesError(f"{manifest}: part {part['name']} has sha256 {digest.hexdigest()}, "
                                      f"the manifest says {part['sha256']}")
        if whole.hexdigest() != spec["sha256"]:
            raise PiecesError(f"{manifest}: {spec['name']} joined has sha256 {whole.hexdigest()}, "
                              f"the manifest says {spec['sha256']}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rhymerl.bench.pieces", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="FILE -> DIR/NAME.partNNN + DIR/NAME.manifest.json")
    s.add_argument("file", type=Path)
    s.add_argument("dir", type=Path)
    s.add_argument("--max-mib", type=int, default=MAX_MIB)
    j = sub.add_parser("join", help="MANIFEST -> OUT, checked")
    j.add_argument("manifest", type=Path)
    j.add_argument("out", type=Path)
    args = p.parse_args(argv)
    try:
        if args.cmd == "split":
            print(split(args.file, args.dir, args.max_mib))
        else:
            print(join(args.manifest, args.out))
    except (OSError, ValueError, KeyError, PiecesError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
