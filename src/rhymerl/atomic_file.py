"""Atomic file writes: a reader (or a run resumed after a crash) sees the old file or the new one, never a
torn mix, and a failed write leaves no temporary file behind. Durable too: data and the rename are fsynced,
so after a power loss the new file is there whole or not at all."""

from __future__ import annotations

import errno
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, making the names created, renamed or removed in it durable."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file under `root` and every directory (`root` included), deepest first: after this a
    rename of `root` publishes contents that are already on disk."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(directory)


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", exclusive: bool = False) -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; on a clean exit flush, fsync and rename it over
    `path` (and fsync the directory, so the rename survives a power loss); on an exception remove it and
    re-raise. `exclusive`: publish it only where `path` does not exist yet, by a hard link, which fails with
    FileExistsError rather than replace a file another process published first (two runs claiming one
    directory); where the file system has no hard links, a check then a rename."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            _publish_new(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(Path(directory))


def _publish_new(tmp: str, path: str) -> None:
    """Give the written file `tmp` the name `path` only if no file has it (FileExistsError otherwise)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # no hard links here (some network and FUSE file systems)
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "File exists", path) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)
