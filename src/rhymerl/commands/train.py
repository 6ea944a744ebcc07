"""`rhymerl train`: a GRPO run from a config (or the embedded default job), or a resumed one; its report
follows."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rhymerl.commands.report import cmd_report
from rhymerl.config import config_help, load_config
from rhymerl.errors import UserError
from rhymerl.rl import torchrun
from rhymerl.rl.loop import TrainingRun


def cmd_train(args) -> int:
    """Run (or resume) the training run, then write its report."""
    if args.resume and args.config:
        # A resumed run keeps the config it started with (RUN_DIR/config.yaml); keys of another file would be
        # silently half-applied, or change a run that must repeat itself.
        raise UserError(f"--resume {args.resume} continues the run with its saved config "
                        f"({Path(args.resume) / 'config.yaml'}); --config cannot be combined with it: give "
                        f"changes as key=value overrides, or start a new run with --config")
    if torchrun.is_worker():  # torchrun's ranks 1..N-1 serve the update; rank 0 (here, below) is the driver
        return torchrun.serve()
    if args.resume:
        run = TrainingRun.resume(args.resume, args.overrides)
    else:
        run = TrainingRun(load_config(args.config, args.overrides))
    if torchrun.launched() and run.cfg.train.world_size == 1:  # the other processes would wait for it forever
        raise UserError(f"torchrun started {os.environ['WORLD_SIZE']} processes and train.world_size is 1: set "
                        f"train.world_size={os.environ['WORLD_SIZE']} (each torchrun process is a rank of the update)")
    print(f"[train] run directory: {run.run_dir} (resume with: rhymerl train --resume {run.run_dir})", file=sys.stderr)
    run_dir = run.run()
    return cmd_report(argparse.Namespace(run_dir=str(run_dir), out=None))


def add_parser(sub) -> None:
    """`train` and its options (the config keys listed in its help), on the top-level subparsers `sub`."""
    t = sub.add_parser("train", help="GRPO training with HistoSpec rollouts (no arguments: the embedded default job)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="configuration keys (YAML sections, or key=value on the command line):\n" + config_help())
    t.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. rollout.temperature=0.6")
    t.add_argument("--config", default=None, help="YAML config file (sections as listed below)")
    t.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue RUN_DIR from its latest checkpoint, with its saved config (+ overrides, recorded "
                        "in RUN_DIR/overrides.jsonl); it imports the reward module that config names, so resume "
                        "only runs you trust")
    t.set_defaults(func=cmd_train)
