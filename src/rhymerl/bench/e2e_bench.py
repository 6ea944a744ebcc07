"""`rhymerl bench e2e`: seconds per GRPO step, TRL's GRPOTrainer vs rhymerl (speculation off, HistoSpec).

All three train the same model on the same built-in prompt set with the same reward, num_generations,
prompts per step, max_completion_length, micro-batch size, learning rate, optimizer, loss and dtype, for the
same number of steps (several epochs of the prompt set, so HistoSpec has history from the second epoch on).
A step is rollout + reward + update (+ weight sync for rhymerl); start-up and checkpoint writing are not
counted on either side. rhymerl's off and HistoSpec runs share the seed, so their reward curves must match
(exactly in fp32; in bf16 a many-token verification forward rounds differently, and the drift is reported).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from rhymerl.bench.console import table_console
from rhymerl.bench.progress import Progress
from rhymerl.bench.training_process import train_in_process
from rhymerl.bench.trl_baseline import TRL_DTYPES, run_trl_grpo
from rhymerl.config import load_config
from rhymerl.data.dataset import Example, builtin_examples
from rhymerl.errors import UserError
from rhymerl.metrics import read_metrics
from rhymerl.model.fetch import resolve_model_dir
from rhymerl.rl.rewards import RewardScorer


def _per_epoch(values: list[float], steps_per_epoch: int) -> list[float]:
    return [round(statistics.mean(values[i : i + steps_per_epoch]), 2) for i in range(0, len(values), steps_per_epoch)]


def _summarise(step_s: list[float], rollout_s: list[float], rewards: list[float], steps_per_epoch: int) -> dict:
    return {"s_per_step": round(statistics.median(step_s), 2),
            "s_per_step_by_epoch": _per_epoch(step_s, steps_per_epoch),
            "rollout_share": round(sum(rollout_s) / sum(step_s), 3),
            "total_s": round(sum(step_s), 1),
            "reward_by_step": [round(r, 4) for r in rewards],
            "final_reward": round(statistics.mean(rewards[-steps_per_epoch:]), 4)}


SPECULATION = ("off", "histospec")  # rhymerl's two runs (rollout.speculative)


def run_rhymerl(overrides: list[str], out_dir: Path, steps_per_epoch: int) -> dict:
    run_dir = train_in_process(overrides, out_dir)  # a process of its own: nothing of TRL's run in it
    rows = [r for r in read_metrics(run_dir) if "timing_s/step" in r]
    # The final checkpoint is written inside the last step; TRL saves nothing, so it is not counted.
    step_s = [r["timing_s/step"] - r.get("timing_s/save", 0.0) for r in rows]
    out = _summarise(step_s, [r["timing_s/rollout"] for r in rows], [r["critic/rewards/mean"] for r in rows],
                     steps_per_epoch)
    out["update_s"] = round(statistics.median(r["timing_s/update"] for r in rows), 2)
    out["rollout_s"] = round(statistics.median(r["timing_s/rollout"] for r in rows), 2)
    out["trained_seq_frac"] = round(sum(r["actor/trained_seqs"] for r in rows) /
                                    sum(r["actor/trained_seqs"] + r["actor/skipped_seqs"] for r in rows), 3)
    if "rollout/spec_accept_rate" in rows[-1]:
        out["accept_rate"] = round(statistics.mean(r["rollout/spec_accept_rate"] for r in rows[steps_per_epoch:]), 3)
        out["tokens_per_forward"] = round(statistics.mean(r["rollout/tokens_per_forward"] for r in rows[steps_per_epoch:]), 3)
    return out


def _check(dtype: str, num_prompts: int, prompts_per_step: int, num_generations: int, micro_batch_size: int,
           skip_trl: bool) -> None:
    """The options every run must accept, checked before anything loads (UserError naming them)."""
    if num_prompts < 1 or prompts_per_step < 1 or num_prompts % prompts_per_step:
        raise UserError(f"bench e2e: --num-prompts ({num_prompts}) must be a multiple of --prompts-per-step "
                        f"({prompts_per_step}): every epoch is whole steps")
    if skip_trl:
        return
    # TRL's own checks (run_trl_grpo), here so that they fail before the model is fetched
    if dtype not in TRL_DTYPES:
        raise UserError(f"bench e2e: --dtype {dtype!r}: TRL runs {' or '.join(TRL_DTYPES)} (or pass --skip-trl)")
    if micro_batch_size < 1 or (prompts_per_step * num_generations) % micro_batch_size:
        raise UserError(f"bench e2e: --micro-batch-size ({micro_batch_size}) must divide --prompts-per-step x "
                        f"--num-generations ({prompts_per_step * num_generations}) for TRL (or pass --skip-trl)")


def run(model: str = "smollm2-135m", dtype: str = "fp32", num_prompts: int = 8, prompts_per_step: int = 2,
        num_generations: int = 4, max_completion_length: int = 128, micro_batch_size: int = 8,
        learning_rate: float = 1e-5, epochs: int = 3, temperature: float = 1.0, format_weight: float = 0.2,
        seed: int = 0, skip_trl: bool = False, overrides: list[str] = ()) -> dict:
    """TRL's run (unless `skip_trl`), then rhymerl's off and HistoSpec runs, each in a process of its own; the
    summary whose JSON is the bench's last line. `overrides`: config keys for both rhymerl runs."""
    _check(dtype, num_prompts, prompts_per_step, num_generations, micro_batch_size, skip_trl)
    steps_per_epoch = num_prompts // prompts_per_step
    steps = epochs * steps_per_epoch
    # progress: each run's steps are its units (the model fetch and TRL's start-up ride on them)
    progress = Progress("e2e", (0 if skip_trl else steps) + 2 * steps)
    common = ["data.task=arithmetic", f"data.num_train_prompts={num_prompts}",
              "val.every=0", f"train.prompts_per_step={prompts_per_step}", f"rollout.num_generations={num_generations}",
              f"rollout.max_completion_length={max_completion_length}", f"train.micro_batch_size={micro_batch_size}",
              f"train.learning_rate={learning_rate}", f"train.total_steps={steps}", f"train.dtype={dtype}",
              f"rollout.dtype={dtype}", f"rollout.temperature={temperature}", f"reward.format_weight={format_weight}",
              f"rollout.num_slots={prompts_per_step * num_generations}", f"run.seed={seed}", "run.save_every=0",
              "run.progress=false", "run.tensorboard=false",
              "train.epsilon_high=0.28",  # as the TRL side (run_trl_grpo's default), DAPO's clip-higher
              *overrides]
    for mode in SPECULATION:  # a bad key or value fails here, before the model loads or a run starts
        load_config(None, common + [f"rollout.speculative={mode}"])
    model_dir = resolve_model_dir(model)
    common.insert(0, f"model.name={model_dir}")
    # The runs' directories hold their final checkpoints (GBs for a real model) and no figure we report:
    # removed when the runs are done.
    with tempfile.TemporaryDirectory(prefix="rhymerl-e2e-") as tmp:
        work = Path(tmp)
        results: dict = {}
        if not skip_trl:
            examples = builtin_examples("arithmetic", num_prompts, seed)
            scorer = RewardScorer(format_weight)

            def reward_fn(texts: list[str], truths: list[str], finished: list[bool]) -> list[float]:
                return scorer.score(texts, [Example("", t, "arithmetic", "trl") for t in truths],
                                    finished=finished).rewards

            progress.stage(f"TRL GRPOTrainer: {steps} steps", units=steps)
            trl = run_trl_grpo(model_dir, [ex.messages() for ex in examples], [ex.ground_truth for ex in examples],
                               reward_fn, num_generations=num_generations, prompts_per_step=prompts_per_step,
                               micro_batch_size=micro_batch_size, max_completion_length=max_completion_length,
                               learning_rate=learning_rate, steps=steps, dtype=dtype, seed=seed, temperature=temperature,
                               output_dir=work / "trl")
            results["trl"] = _summarise(trl.step_s, trl.rollout_s, trl.reward_mean, steps_per_epoch)
            results["trl"]["trl_version"] = trl.trl_version
        for mode in SPECULATION:
            progress.stage(f"rhymerl, speculative={mode}: {steps} steps (+ model load)", units=steps)
            results[mode] = run_rhymerl(common + [f"rollout.speculative={mode}"], work / mode, steps_per_epoch)

    progress.done()
    off, spec = results["off"], results["histospec"]
    diff = max(abs(a - b) for a, b in zip(off["reward_by_step"], spec["reward_by_step"]))
    summary = {"model": model, "dtype": dtype, "device": "cuda" if torch.cuda.is_available() else "cpu",
               "threads": torch.get_num_threads(), "num_prompts": num_prompts, "prompts_per_step": prompts_per_step,
               "num_generations": num_generations, "max_completion_length": max_completion_length,
               "micro_batch_size": micro_batch_size, "learning_rate": learning_rate, "steps": steps, "epochs": epochs,
               "runs": results, "off_s_per_step": off["s_per_step"], "spec_s_per_step": spec["s_per_step"],
               "spec_speedup_vs_off": round(off["s_per_step"] / spec["s_per_step"], 3),
               "reward_curve_max_abs_diff": round(diff, 6)}
    if "trl" in results:
        summary["trl_s_per_step"] = results["trl"]["s_per_step"]
        summary["speedup_vs_trl"] = round(results["trl"]["s_per_step"] / spec["s_per_step"], 3)
        summary["off_speedup_vs_trl"] = round(results["trl"]["s_per_step"] / off["s_per_step"], 3)
    return summary


def print_table(summary: dict, console: Console | None = None) -> None:
    console = console or table_console()
    t = Table(title=f"GRPO end to end: {summary['model']} {summary['dtype']}, {summary['num_prompts']} prompts, "
                    f"{summary['prompts_per_step']} x {summary['num_generations']} per step, "
                    f"max_completion_length={summary['max_completion_length']}, {summary['steps']} steps")
    for c in ("run", "s/step (median)", "s/step by epoch", "rollout share", "final reward", "speedup vs TRL"):
        t.add_column(c, justify="right")
    trl = summary["runs"].get("trl")
    for name, label in (("trl", "TRL GRPOTrainer"), ("off", "rhymerl, spec off"), ("histospec", "rhymerl, HistoSpec")):
        r = summary["runs"].get(name)
        if r is None:
            continue
        speed = f"{trl['s_per_step'] / r['s_per_step']:.2f}x" if trl else "-"
        t.add_row(label, str(r["s_per_step"]), str(r["s_per_step_by_epoch"]), str(r["rollout_share"]),
                  str(r["final_reward"]), speed)
    console.print(t)
    console.print(f"reward curves, spec off vs HistoSpec: max |diff| = {summary['reward_curve_max_abs_diff']}")
