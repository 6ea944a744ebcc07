"""What the subcommands share: option types and checks that fail before any model loads, naming the option
(`UserError`, one line from `rhymerl.cli.main`), the help texts and the help formatter."""

from __future__ import annotations

import argparse

import torch

from rhymerl.errors import UserError
from rhymerl.model.fetch import BUILTIN_MODELS, RANDOM_MODELS
from rhymerl.model.pretrained import DTYPES, default_device
from rhymerl.process import setup_process

MODEL_HELP = (f"built-in name ({', '.join(BUILTIN_MODELS)}; {', '.join(RANDOM_MODELS)}: random weights, "
              f"for throughput figures only), HF directory, .gguf file or hub id")
DEVICE_HELP = "cpu or cuda (default: cuda when available)"


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default after its help, unless there is none or the help already names it."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def check_device(name: str | None) -> str:
    """`--device` as given (default: cuda when available), checked: a device torch knows, cpu or cuda, and
    a GPU only where one is available."""
    if name is None:
        return default_device()
    try:
        kind = torch.device(name).type
    except RuntimeError:
        raise UserError(f"--device {name!r}: not a device; use cpu or cuda (cuda:N for the N-th GPU)") from None
    if kind not in ("cpu", "cuda"):
        raise UserError(f"--device {name!r}: rhymerl runs on cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name!r}: no CUDA GPU is available here (torch.cuda.is_available() is false); "
                        f"use --device cpu")
    return name


def check_dtype(name: str, option: str = "--dtype") -> str:
    """A dtype option as given, checked: auto or one `parse_dtype` knows (it would refuse it only once the
    model loads)."""
    if name != "auto" and name not in DTYPES:
        raise UserError(f"{option} {name!r}: not a dtype; use auto, {', '.join(DTYPES)}")
    return name


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (`--num-slots 0` would wait forever for a free slot)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def number_list(text: str, option: str, kind: type = int, least: float = 1) -> list:
    """A comma-separated option (`--batches 1,8,32`) as a list of `kind`, each at least `least`; a UserError
    naming `option` otherwise (checked before the bench starts, where a bad item used to be a traceback)."""
    what = "integers" if kind is int else "numbers"
    try:
        values = [kind(item) for item in text.split(",")]
    except ValueError:
        raise UserError(f"{option} {text!r}: expected comma-separated {what}, e.g. {option} "
                        f"{'1,8,32' if kind is int else '0.3,1.0'}") from None
    low = [v for v in values if not v >= least]  # `not >=`: NaN is refused too
    if low:
        raise UserError(f"{option} {text!r}: every value must be at least {least:g}, got {low[0]:g}")
    return values


def setup(args) -> None:
    """This process's settings (`setup_process`), for the commands that run an engine; `train` makes them
    in its TrainingRun, with the run's seed."""
    setup_process(device=check_device(getattr(args, "device", None)))
