"""The `rhymerl` command: train, report, generate, bench (each a module of `rhymerl.commands`).

Bad input (a config key, a file, a model directory, a checkpoint, an option) ends in one line, `rhymerl:
error: <message>` naming it and what to do, and exit code 2; rollout workers failing past
`rollout.max_worker_restarts` (`WorkersFailed`) end in one such line with exit code 1; `rhymerl --debug
<command>` shows the traceback instead. Only the known bad-input exceptions (`USER_ERRORS`, and an OSError the system raised about a named
file) are turned into that line: anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import sys

# The commands moved to rhymerl.commands; their names stay importable from here.
from rhymerl.commands.bench import (cmd_bench_e2e, cmd_bench_engine, cmd_bench_matmul,  # noqa: F401
                                    cmd_bench_spec, cmd_bench_workers)
from rhymerl.commands.bench_pipe import cmd_bench_pipe  # noqa: F401
from rhymerl.commands.generate import cmd_generate, encode  # noqa: F401
from rhymerl.commands.options import DEVICE_HELP, MODEL_HELP, check_device, positive_int, setup  # noqa: F401
from rhymerl.commands.parser import build_parser
from rhymerl.commands.report import cmd_report  # noqa: F401
from rhymerl.commands.train import cmd_train  # noqa: F401
from rhymerl.config import ConfigError
from rhymerl.errors import UserError
from rhymerl.rl.rewards import RewardFunctionError
from rhymerl.rollout.types import WorkersFailed

# The exceptions that mean "bad input" (each names what is wrong); main prints them as one line.
USER_ERRORS = (UserError, ConfigError, RewardFunctionError)
# OSErrors about the machine rather than the code: a file that cannot be read or written where the user
# pointed (permissions, a full or read-only disk, a missing file, a directory where a file belongs).
ENVIRONMENT_ERRNOS = {errno.EACCES: "check its permissions or choose another path",
                      errno.EPERM: "check its permissions or choose another path",
                      errno.EROFS: "the file system is read-only: choose another path",
                      errno.ENOSPC: "the disk is full: free space or choose another path",
                      errno.EDQUOT: "the disk quota is used up: free space or choose another path",
                      errno.ENOENT: "check the path", errno.ENOTDIR: "check the path",
                      errno.EISDIR: "a directory is where a file belongs: check the path",
                      errno.EEXIST: "remove it or choose another path",
                      errno.ENAMETOOLONG: "choose a shorter path"}


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for bad input, reported in one line unless --debug)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        if args.debug:
            raise
        return _fail(str(e))
    except WorkersFailed as e:  # not bad input, but a known end: one line, the checkpoint intact (exit code 1)
        if args.debug:
            raise
        return _fail(str(e), code=1)
    except OSError as e:
        message = _environment_message(e)
        if args.debug or message is None:  # not about a file the user named: a bug, keep its traceback
            raise
        return _fail(message)


def _environment_message(e: OSError) -> str | None:
    """One line for an OSError about the machine (see ENVIRONMENT_ERRNOS) or one raised with a message by
    rhymerl itself (e.g. FileNotFoundError("--trace X: no such file")); None for any other."""
    if e.errno is None and len(e.args) == 1 and isinstance(e.args[0], str):
        return e.args[0]
    if e.errno in ENVIRONMENT_ERRNOS and e.filename is not None:
        return f"{e.filename}: {e.strerror}: {ENVIRONMENT_ERRNOS[e.errno]}"
    return None


def _fail(message: str, code: int = 2) -> int:
    print(f"rhymerl: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
