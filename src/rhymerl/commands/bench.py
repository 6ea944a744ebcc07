"""`rhymerl bench`: the benchmarks, each printing a table, then its summary as one JSON line: engine (our
engine vs transformers generate), spec (HistoSpec vs plain decoding), pipe (HistoPipe schedules: its command
and options are `commands.bench_pipe`'s), matmul (AMX tiles vs oneDNN), e2e (seconds per GRPO step vs TRL),
workers (local vs Ray workers) and update (the policy update in one process vs 2 ranks).

Each command checks its list and dtype options before anything loads (`options.number_list`,
`options.check_dtype`); the benches check the rest of their input (`rhymerl.bench`).
"""

from __future__ import annotations

import json
import sys

from rhymerl.bench import e2e_bench, engine_bench, history_bench, matmul_bench, spec_bench, update_bench, workers_bench
from rhymerl.commands.bench_pipe import add_pipe_parser
from rhymerl.commands.options import (DEVICE_HELP, MODEL_HELP, DefaultsHelp, check_dtype, number_list, positive_int,
                                      setup)
from rhymerl.config import DRAFT_RULES
from rhymerl.errors import UserError


def _report(module, summary: dict) -> int:
    """The bench's table, then its summary as the last line (JSON)."""
    module.print_table(summary)
    print(json.dumps(summary))
    return 0


def cmd_bench_engine(args) -> int:
    """`bench engine`: our engine vs transformers generate, per batch size."""
    batches = number_list(args.batches, "--batches") if args.batches else None  # None: by device
    check_dtype(args.dtype)
    setup(args)
    return _report(engine_bench, engine_bench.run(args.model, args.dtype, batches, args.num_prompts, args.max_tokens,
                                                  args.temperature, args.top_p, args.seed, args.skip_hf, args.device,
                                                  args.hf_modes, args.hf_batches, args.backend))


def cmd_bench_spec(args) -> int:
    """`bench spec`: HistoSpec vs plain decoding on a second epoch of the same prompts."""
    temperatures = number_list(args.temperatures, "--temperatures", float, least=0)
    check_dtype(args.dtype)
    setup(args)
    summary = spec_bench.run(spec_bench.SpecBenchConfig(
        args.model, args.dtype, tuple(temperatures), args.num_prompts, args.num_generations, args.slots,
        args.max_tokens, args.data, args.identity_prompts, args.identity_max_tokens, args.seed, args.draft_rule,
        args.max_draft_tokens, args.history_from, args.repeats, args.epoch_seeds, args.device, args.reward_aware))
    return _report(spec_bench, summary)


def cmd_bench_matmul(args) -> int:
    """`bench matmul`: one forward's bf16 matmuls, AMX tiles vs oneDNN."""
    rows = number_list(args.rows, "--rows")
    return _report(matmul_bench, matmul_bench.run(args.model, rows, args.repeats, args.seed))


def cmd_bench_e2e(args) -> int:
    """`bench e2e`: seconds per GRPO step, TRL's GRPOTrainer vs rhymerl (speculation off, HistoSpec); with
    `--compare history`, rhymerl with history on vs off on Ray workers."""
    # workload options left out (None) take each comparison's defaults: TRL's small arithmetic job, or part 1's
    # rhyming workload for --compare history|stream (history_bench.workload)
    named = ("num_prompts", "prompts_per_step", "num_generations", "max_completion_length", "epochs", "temperature")
    given = {k: getattr(args, k) for k in named if getattr(args, k) is not None}
    if args.compare in history_bench.COMPARES:
        return _report(history_bench, history_bench.run(
            args.model, args.dtype, args.workers, args.mode, args.learning_rate, args.skip_steps, args.seed,
            compare=args.compare, history=args.history, train_dtype=args.train_dtype, data=args.data,
            num_slots=args.slots, max_draft_tokens=args.max_draft_tokens, overrides=args.overrides, **given))
    if args.train_dtype is not None:
        raise UserError("bench e2e --train-dtype: only with --compare history|stream (TRL and rhymerl share --dtype)")
    summary = e2e_bench.run(args.model, args.dtype, micro_batch_size=args.micro_batch_size,
                            learning_rate=args.learning_rate, format_weight=args.format_weight, seed=args.seed,
                            skip_trl=args.skip_trl, overrides=args.overrides, **given)
    return _report(e2e_bench, summary)


def cmd_bench_workers(args) -> int:
    """`bench workers`: seconds per GRPO step, local 1 worker vs Ray 1 and 2 workers."""
    return _report(workers_bench, workers_bench.run(args.overrides, args.steps, args.warmup, args.repeats, args.dtype,
                                                    args.out))


def cmd_bench_update(args) -> int:
    """`bench update`: seconds per update, one process vs 2 ranks (FSDP2, DDP), and the collectives' bytes."""
    check_dtype(args.dtype)
    setups = [s.strip() for s in args.setups.split(",")]
    unknown = [s for s in setups if s not in update_bench.SETUPS]
    if unknown:
        raise UserError(f"--setups: unknown {unknown[0]!r}; expected some of {', '.join(update_bench.SETUPS)}")
    summary = update_bench.run(args.model, args.dtype, args.prompts, args.generations, args.prompt_len,
                               args.max_completion_length, args.micro_batch_size, args.steps, args.warmup,
                               tuple(setups))
    code = _report(update_bench, summary)
    missed = update_bench.missed(summary) if args.check else []
    for line in missed:
        print(f"bench update --check: {line}", file=sys.stderr)
    return 1 if missed else code


def add_parser(sub) -> None:
    """`bench` and its benchmarks with their options, on the top-level subparsers `sub`."""
    b = sub.add_parser("bench", help="benchmarks (table, then a JSON line)")
    bsub = b.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="our engine vs transformers generate", formatter_class=DefaultsHelp)
    be.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    be.add_argument("--dtype", default="auto", help="auto | bf16 | fp32, for both sides (auto: bf16 where native, else fp32)")
    be.add_argument("--batches", default=None,
                    help="comma-separated batch sizes (slots for our engine); default: 1,8,32 on a CPU, 1,8,32,128 on CUDA")
    be.add_argument("--num-prompts", type=positive_int, default=None,
                    help="default: 8 at batch 1, 32 at 8, 128 at 32, 512 at 128 (4 x batch)")
    be.add_argument("--max-tokens", type=positive_int, default=256, help="max_completion_length")
    be.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    be.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    be.add_argument("--seed", type=int, default=0, help="sampling seed and prompt-set seed")
    be.add_argument("--hf-modes", default="eager",
                    help="comma-separated transformers generate modes: eager, static (static KV cache), compiled "
                         "(static cache + torch.compile); each warmed up untimed")
    be.add_argument("--hf-batches", type=positive_int, default=engine_bench.HF_BATCHES,
                    help="transformers runs at most this many batches of each batch size (a rate is a rate: its "
                         "eager mode is the slow side)")
    be.add_argument("--skip-hf", action="store_true", help="only our engine (no --hf-modes)")
    be.add_argument("--device", default=None, help=DEVICE_HELP)
    be.add_argument("--backend", default="auto", choices=engine_bench.BACKENDS,
                    help="our engine's backend: the device's own, or static: the fixed-shape steps CUDA graphs "
                         "replay, run eagerly (on a CPU: a GPU step's host work, measured where no GPU is)")
    be.set_defaults(func=cmd_bench_engine)
    bs = bsub.add_parser("spec", help="HistoSpec vs plain decoding on a second epoch of the same prompts",
                         formatter_class=DefaultsHelp)
    bs.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    bs.add_argument("--dtype", default="auto", help="dtype of the timed rollouts, auto = bf16 where native, else fp32 (identity and the fp32 tail always run in fp32)")
    bs.add_argument("--temperatures", default="0.3,0.6,1.0", help="comma-separated sampling temperatures")
    bs.add_argument("--num-prompts", type=positive_int, default=16,
                    help="distinct prompts (each recurs in the second epoch)")
    bs.add_argument("--num-generations", type=positive_int, default=8, help="responses per prompt and epoch")
    bs.add_argument("--slots", type=positive_int, default=32, help="sequences decoded together")
    bs.add_argument("--max-tokens", type=positive_int, default=256, help="max_completion_length")
    bs.add_argument("--data", default=None, help="a built-in task (arithmetic, countdown) or a JSONL file with 'prompt' or 'question' (default: arithmetic)")
    bs.add_argument("--repeats", type=positive_int, default=3,
                    help="plain and HistoSpec rollouts (full batch and tail) alternate this many times; each keeps its "
                         "fastest (with 2, a machine whose speed drifts by a few percent left one side on a slow "
                         "stretch in some runs)")
    bs.add_argument("--epoch-seeds", type=positive_int, default=1,
                    help="timed epochs with seeds seed+2000, seed+2001, ...; figures are totals over them (the tail and "
                         "identity use the first)")
    bs.add_argument("--identity-prompts", type=int, default=16, help="prompts (x2) for the fp32 identity check")
    bs.add_argument("--identity-max-tokens", type=positive_int, default=96,
                    help="max_completion_length of the identity check")
    bs.add_argument("--draft-rule", default="cost", choices=DRAFT_RULES,
                    help="per-sequence draft length rule (the step budget applies to all)")
    bs.add_argument("--max-draft-tokens", type=positive_int, default=None,
                    help="draft tokens per sequence and step, at most (default: as rollout.max_draft_tokens=0, by "
                         "the dtype: 32 in bf16, 4 in fp32)")
    bs.add_argument("--seed", type=int, default=0, help="history epoch samples with seed + 1000, the timed epoch with seed + 2000")
    bs.add_argument("--history-from", default=None, metavar="RUN_DIR",
                    help="draft from a training run's saved history (and use its policy and prompts)")
    bs.add_argument("--reward-aware", action="store_true",
                    help="a third run in every round drafts reward-aware (rollout.reward_aware_drafting: branches of "
                         "higher-reward responses first), paired with plain-priority HistoSpec on the same cost "
                         "model; with --history-from, whose history carries the run's rewards")
    bs.add_argument("--device", default=None, help=DEVICE_HELP)
    bs.set_defaults(func=cmd_bench_spec)
    add_pipe_parser(bsub)
    bm = bsub.add_parser("matmul", help="one forward's bf16 matmuls: AMX tiles vs oneDNN (CPUs with AMX)",
                         formatter_class=DefaultsHelp)
    bm.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    bm.add_argument("--rows", default="1,8,32,64,96,128", help="comma-separated tokens per step")
    bm.add_argument("--repeats", type=positive_int, default=7,
                    help="timed runs of each kernel, alternating; the median counts")
    bm.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    bm.set_defaults(func=cmd_bench_matmul)
    b2 = bsub.add_parser("e2e", help="seconds per GRPO step: TRL GRPOTrainer vs rhymerl (off, HistoSpec)",
                         formatter_class=DefaultsHelp)
    b2.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    b2.add_argument("--dtype", default="fp32", help="fp32 (TRL's CPU default) or bf16, for every run (--compare "
                    "history|stream: rollout.dtype, and train.dtype unless --train-dtype)")
    b2.add_argument("--num-prompts", type=positive_int, default=None,
                    help="size of the built-in prompt set (default: 8; --compare history|stream: part 1's 12)")
    b2.add_argument("--prompts-per-step", type=positive_int, default=None,
                    help="prompts per GRPO step (default: 2; --compare history|stream: 12, part 1's call)")
    b2.add_argument("--num-generations", type=positive_int, default=None,
                    help="responses per prompt (default: 4; --compare history|stream: part 1's 8)")
    b2.add_argument("--max-completion-length", type=positive_int, default=None,
                    help="response tokens, at most (default: 128; --compare history|stream: part 1's 192)")
    b2.add_argument("--micro-batch-size", type=positive_int, default=8,
                    help="sequences per forward/backward in the update")
    b2.add_argument("--learning-rate", type=float, default=1e-5, help="AdamW, constant")
    b2.add_argument("--epochs", type=positive_int, default=None,
                    help="passes over the prompt set (default: 3; --compare history|stream: 6)")
    b2.add_argument("--temperature", type=float, default=None,
                    help="rollout sampling temperature (default: 1.0; --compare history|stream: part 1's 0.6)")
    b2.add_argument("--format-weight", type=float, default=0.2, help="reward = correctness + weight x format")
    b2.add_argument("--seed", type=int, default=0, help="one seed for every run")
    b2.add_argument("--skip-trl", action="store_true", help="only the two rhymerl runs")
    b2.add_argument("--compare", choices=("trl", "history", "stream"), default="trl",
                    help="trl: TRL vs rhymerl (off, HistoSpec), local rollout; history: rhymerl with history on "
                         "(HistoSpec, rollout.schedule=histopipe, migration in sync, rollout.stream in "
                         "one_step_off) vs off (plain, static, none) on --workers Ray workers in --mode, the paper's "
                         "own measure; stream: --mode one_step_off with rollout.stream on vs off, history as --history")
    b2.add_argument("--mode", choices=("sync", "one_step_off"), default="sync",
                    help="--compare history|stream: rollout.mode of both runs")
    b2.add_argument("--history", choices=("on", "off"), default="on",
                    help="--compare stream: both runs' history settings (on: HistoSpec and the histopipe split; "
                         "off: plain decoding, static split)")
    b2.add_argument("--train-dtype", choices=("fp32", "bf16", "auto"), default=None,
                    help="--compare history|stream: train.dtype (bf16: autocast over fp32 master weights), default "
                         "--dtype; with --dtype fp32 (the rollout's) the reward curves stay identical in sync mode (in "
                         "one_step_off a bf16 update may part them: see `rhymerl.bench.history_bench`)")
    b2.add_argument("--workers", type=positive_int, default=2, help="--compare history|stream: Ray rollout workers")
    b2.add_argument("--data", default=None,
                    help="--compare history|stream: the built-in task (data.task; default: part 1's repeat)")
    b2.add_argument("--slots", type=positive_int, default=None,
                    help="--compare history|stream: rollout.num_slots per worker (default: part 1's, 12 on 2 workers)")
    b2.add_argument("--max-draft-tokens", type=positive_int, default=None,
                    help="--compare history|stream: rollout.max_draft_tokens (default: the run's machine default, 4 in "
                         "fp32, 32 in bf16)")
    b2.add_argument("--skip-steps", type=int, default=2,
                    help="--compare history|stream: first steps left out of the medians (no history yet, start-up)")
    b2.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override of every rhymerl run (repeatable), e.g. ray.address=HOST:PORT to run "
                         "on a running cluster")
    b2.set_defaults(func=cmd_bench_e2e)
    bw = bsub.add_parser("workers", help="seconds per GRPO step: local 1 worker, Ray 1 worker, Ray 2 workers",
                         formatter_class=DefaultsHelp)
    bw.add_argument("--steps", type=int, default=4, help="timed steps per setup (after the warm-up)")
    bw.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    bw.add_argument("--repeats", type=int, default=1, help="runs of every setup, alternating order")
    bw.add_argument("--dtype", default="auto", help="rollout.dtype and train.dtype (auto | bf16 | fp32)")
    bw.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override of the default job (repeatable), e.g. rollout.max_completion_length=32")
    bw.add_argument("--out", default=None, help="keep the runs' directories here (default: a temporary folder)")
    bw.set_defaults(func=cmd_bench_workers)
    bu = bsub.add_parser("update", help="seconds per policy update: one process vs 2 ranks (train.world_size=2), "
                                        "and the bytes of the collectives", formatter_class=DefaultsHelp)
    bu.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    bu.add_argument("--dtype", default="fp32", help="train.dtype (auto | bf16 | fp32)")
    bu.add_argument("--prompts", type=positive_int, default=2, help="prompts per batch (the default job's in fp32)")
    bu.add_argument("--generations", type=positive_int, default=8, help="completions per prompt")
    bu.add_argument("--prompt-len", type=positive_int, default=64, help="tokens per (random) prompt")
    bu.add_argument("--max-completion-length", type=positive_int, default=128,
                    help="completions have between half and all of this many tokens")
    bu.add_argument("--micro-batch-size", type=positive_int, default=8,
                    help="sequences per forward/backward on each rank; 8: the default job's 16 sequences make 2 "
                         "micro-batches, one a rank at 2 ranks (at 16 one rank would only pad)")
    bu.add_argument("--steps", type=positive_int, default=3, help="timed updates per setup")
    bu.add_argument("--warmup", type=int, default=1, help="untimed updates first")
    bu.add_argument("--setups", default=",".join(update_bench.SETUPS), help="comma-separated, of: "
                    + ", ".join(update_bench.SETUPS))
    bu.add_argument("--check", action="store_true",
                    help="exit 1 when a multi-rank setup's losses, grad norms or final weights differ from one "
                         "process's by more than 1e-5 relative (needs the setup 'one'; fp32)")
    bu.set_defaults(func=cmd_bench_update)
