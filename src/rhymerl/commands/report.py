"""`rhymerl report`: PNG plots and a one-line summary of a training run (`rhymerl.report`)."""

from __future__ import annotations

from pathlib import Path

from rhymerl import report


def cmd_report(args) -> int:
    """Write the run's report and print its summary and the files written."""
    paths = report.write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    s = report.summary(Path(args.run_dir))
    print(f"[report] {args.run_dir}: {s['steps']} steps; reward {s['reward_first']} -> {s['reward_last']} "
          f"(max {s['reward_max']}); val accuracy {s['val_accuracy_last']}; median step {s['step_time_median_s']} s; "
          f"mean accept rate {s['accept_rate_mean']}")
    for path in paths:
        print(f"[report] wrote {path}")
    return 0


def add_parser(sub) -> None:
    """`report` and its options, on the top-level subparsers `sub`."""
    r = sub.add_parser("report", help="PNG plots and a summary of a training run")
    r.add_argument("run_dir", help="the run directory (holds metrics.jsonl)")
    r.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    r.set_defaults(func=cmd_report)
