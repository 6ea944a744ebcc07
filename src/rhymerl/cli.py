"""The `rhymerl` command: train, report, generate, bench.

Bad input (a config key, a file, a model directory, a checkpoint, an option) ends in one line, `rhymerl:
error: <message>` naming it and what to do, and exit code 2; `rhymerl --debug <command>` shows the traceback
instead. Only the known bad-input exceptions (`USER_ERRORS`, and an OSError the system raised about a named
file) are turned into that line: anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
from pathlib import Path

import torch

from rhymerl import report
from rhymerl.bench import e2e_bench, engine_bench, matmul_bench, pipe_bench, spec_bench, workers_bench
from rhymerl.config import DRAFT_RULES, ConfigError, config_help, load_config
from rhymerl.engine.engine import Engine, StepEvent
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.errors import UserError
from rhymerl.model.capacity import check_context
from rhymerl.model.config import ModelConfig
from rhymerl.model.fetch import resolve_model_dir
from rhymerl.model.pretrained import DTYPES, chat_prompt_ids, default_device, load_pretrained, parse_dtype
from rhymerl.process import setup_process
from rhymerl.rl.loop import TrainingRun
from rhymerl.rl.rewards import RewardFunctionError
from rhymerl.tasks.prompt_file import read_prompt_file

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


def encode(tokenizer, prompt, chat: bool) -> list[int]:
    return tokenizer.encode(prompt) if isinstance(prompt, str) and not chat else chat_prompt_ids(tokenizer, prompt)


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


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (`--num-slots 0` would wait forever for a free slot)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def setup(args) -> None:
    """This process's settings (`setup_process`), for the commands that run an engine; `train` makes them
    in its TrainingRun, with the run's seed."""
    setup_process(device=check_device(getattr(args, "device", None)))


def cmd_generate(args) -> int:
    # Every option and file is checked before the model loads: a mistake costs no waiting.
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_tokens=args.max_tokens, stop=tuple(args.stop), seed=args.seed)
    except ValueError as e:  # SamplingParams' range checks, naming the field
        raise UserError(f"generate: {e} (--temperature, --top-k, --top-p, --max-tokens, --stop)") from None
    setup(args)
    prompts = list(args.prompts) + ([row.prompt for row in read_prompt_file(Path(args.file))] if args.file else [])
    if not prompts:
        raise UserError("generate: no prompts (give them as arguments or with --file FILE.jsonl)")
    device = check_device(args.device)
    model_dir = resolve_model_dir(args.model)
    context = ModelConfig.from_dir(model_dir).max_position_embeddings
    max_model_len = args.max_model_len or min(2048, context)
    check_context(model_dir, max_model_len=max_model_len, num_slots=args.num_slots,
                  dtype=parse_dtype(args.dtype, device), device=device, key="--max-model-len", slots_key="--num-slots")
    model, tokenizer, model_dir = load_pretrained(str(model_dir), args.dtype, device)
    engine = Engine(model, tokenizer, num_slots=args.num_slots, max_model_len=max_model_len)
    ids = [encode(tokenizer, p, not args.no_chat_template) for p in prompts]
    shown: dict = {}

    def stream(ev: StepEvent) -> None:  # print each request's new text as it arrives
        if len(prompts) == 1:
            done = shown.get(ev.request_id, [])
            done += ev.new_token_ids
            text = tokenizer.decode(done, skip_special_tokens=True)
            sys.stdout.write(text[len(tokenizer.decode(done[: -len(ev.new_token_ids)], skip_special_tokens=True)):])
            sys.stdout.flush()
            shown[ev.request_id] = done
        elif ev.output is not None:
            print(f"[{ev.request_id}] {ev.output.text if ev.output.error is None else 'ERROR: ' + ev.output.error}", flush=True)

    outs = engine.generate(ids, params, request_ids=list(range(len(ids))), progress=not args.stream and len(ids) > 1,
                           on_event=stream if args.stream else None)
    for i, o in enumerate(outs):
        if args.json:
            print(json.dumps({"prompt": prompts[i], "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason, "error": o.error}))
        elif not args.stream:
            print(f"--- [{i}] {o.finish_reason}, {len(o.token_ids)} tokens")
            print(o.text if o.error is None else f"ERROR: {o.error}")
        elif o.error is not None and len(prompts) == 1:
            print(f"ERROR: {o.error}")
    s = engine.stats
    print(f"\n[{model_dir.name}] {s.generated_tokens} tokens in {s.busy_s:.2f} s "
          f"({s.generated_tokens / max(s.busy_s, 1e-9):.1f} tok/s, {s.forward_passes} forwards)", file=sys.stderr)
    return 1 if all(o.error for o in outs) else 0


def cmd_train(args) -> int:
    if args.resume and args.config:
        # A resumed run keeps the config it started with (RUN_DIR/config.yaml); keys of another file would be
        # silently half-applied, or change a run that must repeat itself.
        raise UserError(f"--resume {args.resume} continues the run with its saved config "
                        f"({Path(args.resume) / 'config.yaml'}); --config cannot be combined with it: give "
                        f"changes as key=value overrides, or start a new run with --config")
    if args.resume:
        run = TrainingRun.resume(args.resume, args.overrides)
    else:
        run = TrainingRun(load_config(args.config, args.overrides))
    print(f"[train] run directory: {run.run_dir} (resume with: rhymerl train --resume {run.run_dir})", file=sys.stderr)
    run_dir = run.run()
    return cmd_report(argparse.Namespace(run_dir=str(run_dir), out=None))


def cmd_report(args) -> int:
    paths = report.write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    s = report.summary(Path(args.run_dir))
    print(f"[report] {args.run_dir}: {s['steps']} steps; reward {s['reward_first']} -> {s['reward_last']} "
          f"(max {s['reward_max']}); val accuracy {s['val_accuracy_last']}; median step {s['step_time_median_s']} s; "
          f"mean accept rate {s['accept_rate_mean']}")
    for path in paths:
        print(f"[report] wrote {path}")
    return 0


def cmd_bench_engine(args) -> int:
    setup(args)
    summary = engine_bench.run(args.model, args.dtype, [int(b) for b in args.batches.split(",")], args.num_prompts,
                               args.max_tokens, args.temperature, args.top_p, args.seed, args.skip_hf, args.device)
    engine_bench.print_table(summary)
    print(json.dumps(summary))
    return 0


def cmd_bench_spec(args) -> int:
    setup(args)
    summary = spec_bench.run(args.model, args.dtype, [float(t) for t in args.temperatures.split(",")],
                             args.num_prompts, args.num_generations, args.slots, args.max_tokens, args.data,
                             args.identity_prompts, args.identity_max_tokens, args.seed, args.draft_rule,
                             args.max_draft_tokens, args.history_from, args.repeats, args.epoch_seeds, args.device,
                             reward_aware=args.reward_aware)
    spec_bench.print_table(summary)
    print(json.dumps(summary))
    return 0


def cmd_bench_pipe(args) -> int:
    if args.cost_from == "measure" or args.real:
        setup(args)
    summary = pipe_bench.run(args.trace, args.cost_from, args.model, args.dtype, args.device,
                             [int(w) for w in args.workers.split(",")], args.slots, args.real, args.repeats,
                             args.real_prompts, args.num_generations, args.real_slots, args.max_tokens,
                             args.temperature, args.seed, args.ray_workers)
    pipe_bench.print_table(summary)
    print(json.dumps(summary))
    return 0


def cmd_bench_matmul(args) -> int:
    summary = matmul_bench.run(args.model, [int(m) for m in args.rows.split(",")], args.repeats, args.seed)
    matmul_bench.print_table(summary)
    print(json.dumps(summary))
    return 0


def cmd_bench_e2e(args) -> int:
    summary = e2e_bench.run(args.model, args.dtype, args.num_prompts, args.prompts_per_step, args.num_generations,
                            args.max_completion_length, args.micro_batch_size, args.learning_rate, args.epochs,
                            args.temperature, args.format_weight, args.seed, args.skip_trl)
    e2e_bench.print_table(summary)
    print(json.dumps(summary))
    return 0


def cmd_bench_workers(args) -> int:
    summary = workers_bench.run(args.overrides, args.steps, args.warmup, args.repeats, args.dtype, args.out)
    workers_bench.print_table(summary)
    print(json.dumps(summary))
    return 0


MODEL_HELP = "built-in name, HF directory, .gguf file or hub id"
DEVICE_HELP = "cpu or cuda (default: cuda when available)"


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default after its help, unless there is none or the help already names it."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rhymerl", description="RL for LLMs with history-accelerated rollouts")
    p.add_argument("--debug", action="store_true",
                   help="on an error, show the traceback (without it, bad input is reported in one line)")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="GRPO training with HistoSpec rollouts (no arguments: the embedded default job)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="configuration keys (YAML sections, or key=value on the command line):\n" + config_help())
    t.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. rollout.temperature=0.6")
    t.add_argument("--config", default=None, help="YAML config file (sections as listed below)")
    t.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue RUN_DIR from its latest checkpoint, with its saved config (+ overrides)")
    t.set_defaults(func=cmd_train)

    r = sub.add_parser("report", help="PNG plots and a summary of a training run")
    r.add_argument("run_dir", help="the run directory (holds metrics.jsonl)")
    r.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    r.set_defaults(func=cmd_report)

    g = sub.add_parser("generate", help="sample completions from a model", formatter_class=_DefaultsHelp)
    g.add_argument("prompts", nargs="*", help="prompt texts (the chat template is applied)")
    g.add_argument("--file", help="JSONL file with a 'prompt' field per row (text or chat messages)")
    g.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], metavar="DTYPE",
                   help="auto | bf16 | fp32 | fp16 (auto: bf16 where the device has native bf16 matmuls, else fp32)")
    g.add_argument("--device", default=None, help=DEVICE_HELP)
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--max-tokens", type=int, default=256, help="max_completion_length")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=0, help="a token's draw depends on (seed, request, position) only")
    g.add_argument("--num-slots", type=positive_int, default=32, help="sequences decoded together")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="prompt + completion tokens per slot (default: 2048, or the model's context if shorter)")
    g.add_argument("--no-chat-template", action="store_true", help="encode prompts as plain text")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--json", action="store_true", help="one JSON object per result")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmarks (table, then a JSON line)")
    bsub = b.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="our engine vs transformers generate", formatter_class=_DefaultsHelp)
    be.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    be.add_argument("--dtype", default="auto", help="auto | bf16 | fp32, for both sides (auto: bf16 where native, else fp32)")
    be.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (slots for our engine)")
    be.add_argument("--num-prompts", type=positive_int, default=None, help="default: 8 at batch 1, 32 at 8, 128 at 32")
    be.add_argument("--max-tokens", type=positive_int, default=256, help="max_completion_length")
    be.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    be.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    be.add_argument("--seed", type=int, default=0, help="sampling seed and prompt-set seed")
    be.add_argument("--skip-hf", action="store_true", help="only our engine")
    be.add_argument("--device", default=None, help=DEVICE_HELP)
    be.set_defaults(func=cmd_bench_engine)
    bs = bsub.add_parser("spec", help="HistoSpec vs plain decoding on a second epoch of the same prompts",
                         formatter_class=_DefaultsHelp)
    bs.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    bs.add_argument("--dtype", default="auto", help="dtype of the timed rollouts, auto = bf16 where native, else fp32 (identity and the fp32 tail always run in fp32)")
    bs.add_argument("--temperatures", default="0.3,0.6,1.0", help="comma-separated sampling temperatures")
    bs.add_argument("--num-prompts", type=positive_int, default=16,
                    help="distinct prompts (each recurs in the second epoch)")
    bs.add_argument("--num-generations", type=positive_int, default=8, help="responses per prompt and epoch")
    bs.add_argument("--slots", type=positive_int, default=32, help="sequences decoded together")
    bs.add_argument("--max-tokens", type=positive_int, default=256, help="max_completion_length")
    bs.add_argument("--data", default=None, help="JSONL with 'prompt' or 'question' (default: built-in arithmetic)")
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
    bs.add_argument("--max-draft-tokens", type=int, default=32, help="draft tokens per sequence and step, at most")
    bs.add_argument("--seed", type=int, default=0, help="history epoch samples with seed + 1000, the timed epoch with seed + 2000")
    bs.add_argument("--history-from", default=None, metavar="RUN_DIR",
                    help="draft from a training run's saved history (and use its policy and prompts)")
    bs.add_argument("--reward-aware", action="store_true",
                    help="HistoSpec drafts reward-aware (rollout.reward_aware_drafting): branches of higher-reward "
                         "responses first; with --history-from, whose history carries the run's rewards")
    bs.add_argument("--device", default=None, help=DEVICE_HELP)
    bs.set_defaults(func=cmd_bench_spec)
    bp = bsub.add_parser("pipe", help="HistoPipe schedules: simulated from a length trace, then real runs: one "
                                      "worker's longest-first vs FIFO admission, and Ray workers under every "
                                      "rollout.schedule (histopipe with migration too)", formatter_class=_DefaultsHelp)
    bp.add_argument("--trace", default=None, metavar="PATH",
                    help="a run directory or its lengths.jsonl (default: the trace shipped with the package, "
                         "rhymerl/histopipe/traces/default.jsonl)")
    bp.add_argument("--cost-from", default="measure", metavar="measure|FILE.json",
                    help="the simulation's cost model: measured on --model at start-up, or a CostModel.as_dict() JSON")
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
    bp.add_argument("--real-prompts", type=positive_int, default=16,
                    help="built-in arithmetic prompts of the real runs")
    bp.add_argument("--num-generations", type=positive_int, default=4, help="responses per prompt in the real runs")
    bp.add_argument("--real-slots", type=positive_int, default=16,
                    help="the real worker's slots (fewer than its requests, "
                                                               "so that admission order matters)")
    bp.add_argument("--max-tokens", type=positive_int, default=128, help="max_completion_length of the real runs")
    bp.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the real runs")
    bp.add_argument("--seed", type=int, default=0,
                    help="the simulated steps' arrival order; the real runs' prompt set (epoch 1 samples with "
                         "seed + 1000, the timed epoch with seed + 2000)")
    bp.set_defaults(func=cmd_bench_pipe)
    bm = bsub.add_parser("matmul", help="one forward's bf16 matmuls: AMX tiles vs oneDNN (CPUs with AMX)",
                         formatter_class=_DefaultsHelp)
    bm.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    bm.add_argument("--rows", default="1,8,32,64,96,128", help="comma-separated tokens per step")
    bm.add_argument("--repeats", type=positive_int, default=7,
                    help="timed runs of each kernel, alternating; the median counts")
    bm.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    bm.set_defaults(func=cmd_bench_matmul)
    b2 = bsub.add_parser("e2e", help="seconds per GRPO step: TRL GRPOTrainer vs rhymerl (off, HistoSpec)",
                         formatter_class=_DefaultsHelp)
    b2.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    b2.add_argument("--dtype", default="fp32", help="fp32 (TRL's CPU default) or bf16, for every run")
    b2.add_argument("--num-prompts", type=positive_int, default=8, help="size of the built-in prompt set")
    b2.add_argument("--prompts-per-step", type=positive_int, default=2, help="prompts per GRPO step")
    b2.add_argument("--num-generations", type=positive_int, default=4, help="responses per prompt")
    b2.add_argument("--max-completion-length", type=positive_int, default=128, help="response tokens, at most")
    b2.add_argument("--micro-batch-size", type=positive_int, default=8,
                    help="sequences per forward/backward in the update")
    b2.add_argument("--learning-rate", type=float, default=1e-5, help="AdamW, constant")
    b2.add_argument("--epochs", type=positive_int, default=3, help="passes over the prompt set")
    b2.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    b2.add_argument("--format-weight", type=float, default=0.2, help="reward = correctness + weight x format")
    b2.add_argument("--seed", type=int, default=0, help="one seed for every run")
    b2.add_argument("--skip-trl", action="store_true", help="only the two rhymerl runs")
    b2.set_defaults(func=cmd_bench_e2e)
    bw = bsub.add_parser("workers", help="seconds per GRPO step: local 1 worker, Ray 1 worker, Ray 2 workers",
                         formatter_class=_DefaultsHelp)
    bw.add_argument("--steps", type=int, default=4, help="timed steps per setup (after the warm-up)")
    bw.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    bw.add_argument("--repeats", type=int, default=1, help="runs of every setup, alternating order")
    bw.add_argument("--dtype", default="auto", help="rollout.dtype and train.dtype (auto | bf16 | fp32)")
    bw.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override of the default job (repeatable), e.g. rollout.max_completion_length=32")
    bw.add_argument("--out", default=None, help="keep the runs' directories here (default: a temporary folder)")
    bw.set_defaults(func=cmd_bench_workers)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for bad input, reported in one line unless --debug)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        if args.debug:
            raise
        return _fail(str(e))
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


def _fail(message: str) -> int:
    print(f"rhymerl: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
