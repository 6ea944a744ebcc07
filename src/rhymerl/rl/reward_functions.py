"""User reward functions: loading them by spec ('module:function' or 'file.py:function'), their weights and
metric names (TRL's reward_funcs / reward_weights), and calling them under a time limit (`reward.timeout_s`).

A call with a time limit runs in a worker process (`RewardWorker`), not in a thread of this one. Chosen over a
daemon thread because:

- a call that never returns can be stopped: the process is killed and a fresh one started, where a thread
  could only be abandoned, spinning on a core (and the GIL) until the run ends;
- the function runs in its process's main thread, where math_verify's own signal-based timeouts work (in
  a thread its `parse` raises ValueError, so every TRL-style accuracy reward would score 0);
- the process is spawned, not forked: the trainer's OpenMP and CUDA state do not survive a fork, and a
  reward function that runs a model (a reward model, a judge) would hang or fail in a forked child.

The price: a worker process per scorer (started on first use, a fraction of a second plus the function's
imports), the completion and the result pickled through a pipe per call (tens of microseconds), and the
function's module state living in that process (a function that counts its calls counts there). The worker is
a daemon process, ended when the run exits, and it ends itself when its parent dies (a watchdog thread), so
nothing is left blocking or running after the run.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import multiprocessing
import os
import pickle
import sys
import threading
import time
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

# A function that times out this many times in a row is stuck, not slow: the run stops (RewardTimeoutError)
# instead of spending timeout_s on every remaining completion.
MAX_CONSECUTIVE_TIMEOUTS = 3
# Seconds a fresh worker process may take to start and import the functions' modules.
WORKER_START_TIMEOUT_S = 120.0


class RewardFunctionError(ValueError):
    """A reward function spec that cannot be loaded (the message names the spec)."""


class RewardTimeoutError(RewardFunctionError):
    """A reward function timed out MAX_CONSECUTIVE_TIMEOUTS calls in a row: it looks stuck, and the run stops."""


class RewardCallError(Exception):
    """One call failed in the worker process: the message is the function's exception as 'Type: message',
    or that it did not return within the time limit (`timed_out`)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def load_reward_function(spec: str) -> Callable:
    """The function named by "package.module:function" or "path/to/file.py:function".

    It is called once per completion with keyword arguments and returns its correctness as a number:

        fn(completion: str, ground_truth: str, data_source: str, prompt: str | list[dict]) -> float

    prompt is the example's text, or its chat messages as [{"role", "content"}, ...]. (verl users: returning
    a dict with a "score" key, as verl's reward functions may, works too.) Raises RewardFunctionError when the
    spec is malformed, the module or file cannot be found or imported, the name is missing or not callable, or
    its signature does not take those keyword arguments (so the run stops before its first step rather than
    training on zero rewards, every call failing).
    """
    target, _, name = spec.rpartition(":")
    if not target or not name.isidentifier():
        raise RewardFunctionError(f"reward function {spec!r}: expected 'package.module:function' or "
                                  f"'path/to/file.py:function'")
    if _is_file(target):
        module = _module_from_file(spec, Path(target))
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name == target or target.startswith(f"{e.name}."):
                raise RewardFunctionError(f"reward function {spec!r}: module {target!r} not found") from None
            raise RewardFunctionError(f"reward function {spec!r}: importing {target!r} failed: {e}") from e
        except Exception as e:
            raise RewardFunctionError(f"reward function {spec!r}: importing {target!r} failed: "
                                      f"{type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        raise RewardFunctionError(f"reward function {spec!r}: {target!r} has no attribute {name!r}")
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardFunctionError(f"reward function {spec!r}: {name!r} is a {type(fn).__name__}, not callable")
    _check_signature(spec, fn)
    return fn


def _check_signature(spec: str, fn: Callable) -> None:
    """Raise RewardFunctionError unless fn can be called with the documented keyword arguments."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without an inspectable signature: its first call will tell
        return
    try:
        signature.bind(completion="", ground_truth="", data_source="", prompt="")
    except TypeError as e:
        raise RewardFunctionError(f"reward function {spec!r}: cannot be called as fn(completion=..., ground_truth="
                                  f"..., data_source=..., prompt=...) ({e}); take these keyword arguments (add "
                                  f"**kwargs for those it does not use)") from None


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _module_from_file(spec: str, path: Path):
    if not path.is_file():
        raise RewardFunctionError(f"reward function {spec!r}: file {str(path)!r} not found")
    # A name of its own per file, registered before running it (dataclasses and pickling look modules up in
    # sys.modules), without shadowing a real module of the same stem.
    module_name = f"rhymerl_reward_{path.stem}_{zlib.crc32(str(path.resolve()).encode()):08x}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardFunctionError(f"reward function {spec!r}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise RewardFunctionError(f"reward function {spec!r}: running {str(path)!r} failed: "
                                  f"{type(e).__name__}: {e}") from e
    return module


@dataclass(frozen=True)
class RewardFunction:
    """A user reward function with its weight and its metric name (`critic/rewards/<name>/mean`). `spec` is
    how a worker process loads it again ('' = the function itself is sent, pickled by reference)."""

    fn: Callable
    weight: float = 1.0
    name: str = ""
    spec: str = ""


def _absolute(spec: str) -> str:
    """A file spec with its path made absolute, so that a worker process started elsewhere finds it."""
    target, _, name = spec.rpartition(":")
    return f"{Path(target).resolve()}:{name}" if _is_file(target) else spec


def named_functions(functions: Sequence[RewardFunction | Callable]) -> list[RewardFunction]:
    """Each as a RewardFunction (a bare callable gets weight 1), every one with a name of its own: the
    function's __name__, with _2, _3, ... after repeats (TRL names its reward metrics by __name__ too)."""
    out, seen = [], {}
    for f in functions:
        f = f if isinstance(f, RewardFunction) else RewardFunction(f)
        base = f.name or getattr(f.fn, "__name__", "reward")
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}_{seen[base]}"
        out.append(RewardFunction(f.fn, f.weight, name, f.spec))
    return out


def load_reward_functions(specs: Sequence[str], weights: Sequence[float] = ()) -> list[RewardFunction]:
    """The functions named by `specs` (see `load_reward_function`) with their `weights` (empty = 1 each).
    Raises RewardFunctionError for a spec that cannot be loaded, ValueError when the counts differ."""
    if weights and len(weights) != len(specs):
        raise ValueError(f"reward.weights: {len(weights)} weights for {len(specs)} reward functions; expected "
                         f"one per function (or none: 1 each)")
    weights = list(weights) or [1.0] * len(specs)
    return named_functions([RewardFunction(load_reward_function(s), float(w), "", _absolute(s))
                            for s, w in zip(specs, weights)])


# ---------------------------------------------------------------- the worker process


def _exit_with_parent(parent: int) -> None:
    # A call stuck in the user's function never reads the pipe again: notice the parent's death here.
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _serve(conn, loaders: list, parent: int) -> None:
    """The worker process: load the functions (a spec, or the function itself), then answer calls
    (index, kwargs) with ("ok", value) or ("error", "Type: message") until the pipe closes."""
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    try:
        fns = [load_reward_function(x) if isinstance(x, str) else x for x in loaders]
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    while True:
        try:
            index, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", fns[index](**kwargs))
        except (Exception, SystemExit) as e:  # a sys.exit() in a reward function is its failure, not ours
            reply = ("error", f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except Exception as e:  # the result does not pickle
            conn.send(("error", f"its result cannot be sent back ({type(e).__name__}: {e})"))


def _stop(proc, conn) -> None:
    conn.close()
    if proc.is_alive():
        proc.kill()
    proc.join(5)


class RewardWorker:
    """Calls `functions` in a spawned worker process, each call limited to `timeout_s` seconds.

    `call` returns the function's value or raises RewardCallError (its exception, or `timed_out` after
    killing the process; the next call starts a fresh one). A function timing out MAX_CONSECUTIVE_TIMEOUTS
    times in a row raises RewardTimeoutError instead, which stops the run. Raises RewardFunctionError at
    construction when a function given without a spec cannot be sent to another process.
    """

    def __init__(self, functions: Sequence[RewardFunction], timeout_s: float):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.functions = list(functions)
        self.timeout_s = timeout_s
        self.loaders = []
        for f in self.functions:
            if not f.spec:
                try:
                    pickle.dumps(f.fn)
                except Exception as e:
                    raise RewardFunctionError(
                        f"reward function {f.name!r} cannot be sent to the reward worker process ({e}): pass it "
                        f"as a 'module:function' spec or define it at a module's top level, or set timeout_s=0 "
                        f"(no time limit, called in this process)") from None
            self.loaders.append(f.spec or f.fn)
        self._streak = [0] * len(self.functions)  # consecutive timeouts per function
        self._proc = self._conn = None
        self._finalizer = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # why not fork: see the module docstring
        parent_conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child_conn, self.loaders, os.getpid()), daemon=True,
                           name="rhymerl-reward-worker")
        proc.start()
        child_conn.close()
        self._proc, self._conn = proc, parent_conn
        self._finalizer = weakref.finalize(self, _stop, proc, parent_conn)  # also when the scorer is dropped
        reply = ("error", f"it did not start within {WORKER_START_TIMEOUT_S:g} s")
        try:
            if parent_conn.poll(WORKER_START_TIMEOUT_S):
                reply = parent_conn.recv()
        except (EOFError, OSError):
            reply = ("error", f"it exited with code {proc.exitcode} while starting")
        if reply[0] != "ready":
            self.close()
            names = ", ".join(f.spec or f.name for f in self.functions)
            raise RewardFunctionError(f"reward functions {names}: the reward worker process failed: {reply[1]}")

    def close(self) -> None:
        """Stop the worker process (a later call starts a new one)."""
        if self._finalizer is not None:
            self._finalizer()
        self._proc = self._conn = self._finalizer = None

    def call(self, index: int, kwargs: dict) -> Any:
        """functions[index](**kwargs) in the worker process, within timeout_s (see the class docstring)."""
        if self._proc is None or not self._proc.is_alive():
            self.close()
            self._start()
        f = self.functions[index]
        try:
            self._conn.send((index, kwargs))
            answered = self._conn.poll(self.timeout_s)
            reply = self._conn.recv() if answered else None
        except (EOFError, OSError):  # the process died in the call (os._exit, a crash)
            code = self._proc.exitcode
            self.close()
            raise RewardCallError(f"the reward worker process died in the call (exit code {code})") from None
        if reply is None:
            self.close()
            self._streak[index] += 1
            if self._streak[index] >= MAX_CONSECUTIVE_TIMEOUTS:
                raise RewardTimeoutError(
                    f"reward function {f.spec or f.name!r} did not return within reward.timeout_s="
                    f"{self.timeout_s:g} s in {self._streak[index]} calls in a row: it looks stuck, so the run "
                    f"stops (fix the function, or raise reward.timeout_s if it is only slow)")
            raise RewardCallError(f"did not return within reward.timeout_s={self.timeout_s:g} s", timed_out=True)
        self._streak[index] = 0
        if reply[0] == "ok":
            return reply[1]
        raise RewardCallError(reply[1])
