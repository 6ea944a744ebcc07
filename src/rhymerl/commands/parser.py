"""The `rhymerl` argument parser: the global options and every subcommand's (`rhymerl.commands`)."""

from __future__ import annotations

import argparse

from rhymerl.commands import bench, generate, report, train


def build_parser() -> argparse.ArgumentParser:
    """The parser of `rhymerl`; each command's parsed arguments carry the function that runs it (`func`)."""
    p = argparse.ArgumentParser(prog="rhymerl", description="RL for LLMs with history-accelerated rollouts")
    p.add_argument("--debug", action="store_true",
                   help="on an error, show the traceback (without it, bad input is reported in one line)")
    sub = p.add_subparsers(dest="command", required=True)
    # the order of `rhymerl --help`
    for command in (train, report, generate, bench):
        command.add_parser(sub)
    return p
