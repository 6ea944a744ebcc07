"""`rhymerl bench pipe`: HistoPipe's schedules, simulated from a length trace, then timed on real workers
(`rhymerl.bench.pipe_bench`): the command and its options. The options' names are checked here where argparse
cannot (`options.number_list`, `options.check_dtype`, the rhyming workload's values); the bench checks its lists
of names (`--modes`, `--migrations`) and the rest of its input.
"""

from __future__ import annotations

import argparse
import json

from rhymerl.bench import pipe_bench, pipe_rhyming
from rhymerl.commands.options import (DEVICE_HELP, MODEL_HELP, DefaultsHelp, check_dtype, number_list, positive_int,
                                      setup)
from rhymerl.config import BUILTIN_TASKS
from rhymerl.errors import UserError
from rhymerl.histopipe.fleet import MIGRATIONS
from rhymerl.histopipe.workload import Rhyming


def names(text: str) -> list[str]:
    """A comma-separated option's names (the bench checks them)."""
    return [m.strip() for m in text.split(",") if m.strip()]


def cmd_bench_pipe(args) -> int:
    """`bench pipe`: HistoPipe's schedules, simulated from a trace, then (with --real) timed on real workers."""
    workers = number_list(args.workers, "--workers")
    check_dtype(args.dtype)
    if args.run_steps < 0:
        raise UserError(f"--run-steps {args.run_steps}: must be >= 0")
    if args.train_s < 0:
        raise UserError(f"--train-s {args.train_s}: must be >= 0")
    if args.max_staleness < 1:
        raise UserError(f"--max-staleness {args.max_staleness}: must be >= 1 (one_step_off trains on samples one "
                        f"version old)")
    rhyming = None
    if args.trace == pipe_rhyming.RHYMING:
        values = {key: getattr(args, f"rhyming_{key}") for key, *_ in pipe_rhyming.OPTIONS}
        try:
            rhyming = Rhyming(**values)
        except ValueError as e:
            raise UserError(f"--rhyming-*: {e}") from None
    if args.cost_from == "measure" or args.real or args.context_cost == "measure":  # auto measures with cost
        setup(args)
    summary = pipe_bench.run(args.trace, args.cost_from, args.model, args.dtype, args.device, workers, args.slots,
                             args.real, args.repeats, args.real_prompts, args.num_generations, args.real_slots,
                             args.max_tokens, args.temperature, args.seed, args.ray_workers, modes=names(args.modes),
                             run_steps=args.run_steps, train_s=args.train_s, out=args.out, rhyming=rhyming,
                             context=args.context_cost, tier2=args.tier2, real_data=args.real_data,
                             defer_tail=args.defer_tail, max_staleness=args.max_staleness,
                             migrations=names(args.migrations), real_history_epochs=args.real_history_epochs)
    pipe_bench.print_table(summary)
    print(json.dumps(summary))  # the last line: the summary
    return 0


def add_pipe_parser(bsub) -> None:
    """`bench pipe` and its options, on the `bench` subparsers `bsub`."""
    bp = bsub.add_parser("pipe", help="HistoPipe schedules: simulated from a length trace, then real runs: one "
                                      "worker's longest-first vs FIFO admission, and Ray workers under every "
                                      "rollout.schedule (histopipe with migration too)", formatter_class=DefaultsHelp)
    bp.add_argument("--trace", default=None, metavar="PATH|rhyming",
                    help="a run directory or its lengths.jsonl (default: the trace shipped with the package, "
                         "rhymerl/histopipe/traces/default.jsonl), or rhyming: the built-in calibrated workload "
                         "(--rhyming-* options; sources in docs/design.md)")
    bp.add_argument("--context-cost", default="auto", metavar="auto|measure|SECONDS[,PAIR_SECONDS]",
                    help="attention in the simulation: seconds per key per decoding sequence (and per pair of a "
                         "migrated request's re-prefill): measured (SDPA on --model's shapes, extrapolated "
                         "linearly past 4,096 keys), given (0: contexts unpriced), or auto: measured with the "
                         "cost model, else the --cost-from file's per_key_s / prefill_per_pair_s, else 0")
    bp.add_argument("--defer-tail", action=argparse.BooleanOptionalAction, default=True,
                    help="the runs in one_step_off defer each step's tail into the next step, as the loop's "
                         "rollout.defer_tail does")
    bp.add_argument("--max-staleness", type=int, default=1,
                    help="with --defer-tail: a deferred request keeps its tokens when they stay within this many "
                         "versions of the weights that train them (rollout.max_staleness), else it runs again "
                         "from scratch")
    bp.add_argument("--tier2", action=argparse.BooleanOptionalAction, default=True,
                    help="histopipe and oracle may split a long group over several workers (HistoPipe's tier 2)")
    for key, kind, default, what in pipe_rhyming.OPTIONS:
        bp.add_argument(f"--rhyming-{key.replace('_', '-')}", dest=f"rhyming_{key}", type=kind, default=default,
                        help=f"--trace rhyming: {what}")
    bp.add_argument("--cost-from", default="measure", metavar="measure|FILE.json",
                    help="the cost model of the simulation, of the real workers' HistoSpec and of their plan: "
                         "measured on --model at start-up, or a CostModel.as_dict() JSON")
    bp.add_argument("--workers", default="8,64,1024", help="comma-separated simulated worker counts")
    bp.add_argument("--slots", type=positive_int, default=32,
                    help="slots per simulated worker (and of the measured cost model)")
    bp.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    bp.add_argument("--dtype", default="auto", help="auto | bf16 | fp32: the cost model's and the real runs'")
    bp.add_argument("--device", default=None, help=DEVICE_HELP)
    bp.add_argument("--real", action=argparse.BooleanOptionalAction, default=True,
                    help="also time real runs: one worker, FIFO vs longest-first admission, then --ray-workers Ray "
                         "workers under every schedule (--no-real: simulation only)")
    bp.add_argument("--repeats", type=positive_int, default=3,
                    help="real runs of each admission order and schedule, in rotating order; the median counts")
    bp.add_argument("--ray-workers", type=int, default=2,
                    help="Ray workers of the real schedule runs (0: one worker's admission orders only)")
    bp.add_argument("--real-data", default=None, choices=BUILTIN_TASKS,
                    help="the built-in task of the real runs (default: repeat under --trace rhyming, the task "
                         "whose recorded trace is histopipe/traces/repeat.jsonl; else arithmetic)")
    bp.add_argument("--real-prompts", type=positive_int, default=None,
                    help="the task's first prompts in the real runs (default: repeat 12, others 16)")
    bp.add_argument("--num-generations", type=positive_int, default=None,
                    help="responses per prompt in the real runs (default: repeat 8, others 4)")
    bp.add_argument("--real-slots", type=positive_int, default=None,
                    help="each real worker's slots (default: repeat as many as keep 4 waves per Ray worker, "
                         "at most 12; others 16)")
    bp.add_argument("--max-tokens", type=positive_int, default=None,
                    help="max_completion_length of the real runs (default: repeat 192, others 128)")
    bp.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature of the real runs (default: repeat 0.6, others 1.0)")
    bp.add_argument("--seed", type=int, default=0,
                    help="the simulated steps' arrival order; the real runs' prompt set (history epoch k samples "
                         "with seed + 1000 (+ k past the first), the timed epoch with seed + 2000)")
    bp.add_argument("--real-history-epochs", type=positive_int, default=None,
                    help="epochs of the real runs recorded into the history before the timed one (default: 1; "
                         "each takes about as long as one timed run per schedule)")
    bp.add_argument("--modes", default="sync,one_step_off",
                    help="rollout modes of the simulated runs of --run-steps steps (sync, one_step_off)")
    bp.add_argument("--migrations", default=",".join(MIGRATIONS),
                    help="the simulated step's migration rules on histopipe's plan, comma-separated (also "
                         "half_busiest+push: simulated only, ~8x half_busiest's time at 1,024 workers)")
    bp.add_argument("--run-steps", type=int, default=4,
                    help="steps of each simulated run per mode (0: the single sync step only)")
    bp.add_argument("--train-s", type=float, default=0.0,
                    help="seconds of each simulated update (0: the workers' bubbles alone)")
    bp.add_argument("--out", default=None,
                    help="folder of the Gantt charts, one PNG per worker count up to 64, policy and mode "
                         "(default: runs/bench-pipe-<UTC time>)")
    bp.set_defaults(func=cmd_bench_pipe)
