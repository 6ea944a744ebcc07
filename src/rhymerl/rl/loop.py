"""The RL loop (DESIGN 1-2): for each step, prompts -> rollout (a `rhymerl.rollout` pool) -> rewards ->
advantages -> update -> weight sync -> history record; validation every `val.every` steps; checkpoints every
`run.save_every`. The loop owns the history store (the truth, checkpointed) and talks to rollout workers
only through the pool: it never touches an engine.

The run is a pure function of its config and seed: the prompts of step t come from a permutation keyed by
(seed, epoch), and every sampled token from keyed randomness (seed, request id, position) with request ids
made of (step, prompt, generation). So a run resumed from a checkpoint repeats exactly what the
uninterrupted run would have done, and HistoSpec on or off gives the same rollouts (up to bf16 rounding).

`rollout.mode=one_step_off` (Ray workers): right after step t's rollout returned and the history recorded it,
a driver thread starts step t+1's rollout on the workers, on the weights step t trains from, while the driver
scores and trains step t; the driver joins it before loading the weights of version t+1, so a weight load
never races a rollout. Step t+1's tokens are still a function of (seed, request ids, weights version t).
The first step, and the step after each checkpoint, roll out synchronously (see `_rolls_ahead`).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from rhymerl.config import ConfigError, TrainConfig, config_to_dict, load_config, save_config
from rhymerl.cost_model import CostModel
from rhymerl.histopipe.predict import LengthPredictor, rank_report
from rhymerl.histopipe.trace import TraceWriter
from rhymerl.history import HistoryStore, prompt_key
from rhymerl.metrics import MetricsLogger, read_metrics
from rhymerl.model.capacity import check_context
from rhymerl.model.fetch import resolve_model_dir
from rhymerl.model.pretrained import parse_dtype, resolve_dtype
from rhymerl.model.weights import load_decoder, to_hf_state_dict
from rhymerl.rl.advantages import grpo_advantages
from rhymerl.rl.checkpoint import (CheckpointError, check_checkpoint, latest_checkpoint, load_checkpoint,
                                  read_spec_state, save_checkpoint, set_rng_state)
from rhymerl.rl.lora import add_lora, merged_parameters
from rhymerl.rl.prompts import Prompt, batch_indices, load_prompts
from rhymerl.rl.rewards import RewardFunctionError, RewardScorer, load_reward_function
from rhymerl.process import deterministic_algorithms, release_freed_memory, setup_process
from rhymerl.rl.trainer import PolicyTrainer, Sample
from rhymerl.rollout import RolloutGroup, RolloutResult, SamplingParams, WorkerConfig
from rhymerl.rollout.factory import make_pool
from rhymerl.rollout.timeline import append_timeline, timeline_metrics


def run_dtypes(cfg: TrainConfig, device: str, saved: dict | None = None) -> dict[str, str]:
    """What the rollout and the update compute in, {"rollout": ..., "train": ...}: a dtype the config names
    as it is; "auto" as the run resolved it when it started (`saved`, from its checkpoint), else as
    `resolve_dtype` decides for `device`. So a run resumed on another kind of machine (bf16 native on one,
    not on the other) keeps its numerics instead of changing recipe halfway; it says so, because it may run
    slower there. An explicit override (`rollout.dtype=fp32` with --resume) switches."""
    out = {}
    for part, name in (("rollout", cfg.rollout.dtype), ("train", cfg.train.dtype)):
        here = resolve_dtype(name, device)
        kept = (saved or {}).get(part) if name == "auto" else None
        if kept and kept != here:
            print(f"[model] {part}.dtype=auto: keeping {kept}, which this run started with ({here} would be "
                  f"the choice on this {device}; set {part}.dtype={here} to switch)", file=sys.stderr)
        out[part] = kept or here
    return out


class TrainingRun:
    """One `rhymerl train` run. `cost_model` fixes HistoSpec's forward-cost model instead of measuring it
    (tests use it to make draft shapes, and so bf16 rounding, independent of timing)."""

    def __init__(self, cfg: TrainConfig, resume_dir: str | Path | None = None, cost_model: CostModel | None = None):
        self.cfg = cfg
        device = "cuda" if torch.cuda.is_available() else "cpu"
        setup_process(cfg.run.seed, device)
        self.run_dir = Path(resume_dir or cfg.run.output_dir or
                            Path("runs") / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt = latest_checkpoint(self.run_dir) if resume_dir else None
        # Checked before anything loads from it (a bad file is named, not met as a parser's traceback later).
        ckpt_state = check_checkpoint(ckpt) if ckpt is not None else None
        if ckpt_state is not None and cfg.train.total_steps < ckpt_state["step"]:
            raise ConfigError(f"train.total_steps={cfg.train.total_steps} is below the step of the checkpoint to "
                              f"resume from ({ckpt}: step {ckpt_state['step']}): set train.total_steps="
                              f"{ckpt_state['step']} or more")
        self.start_step = 0

        # ---- model: fp32 master weights for the trainer (each rollout worker keeps a copy in its dtype) ----
        self.model_dir = resolve_model_dir(cfg.model.name)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        lora = cfg.model.lora_r > 0
        # With LoRA the checkpoint's merged weights cannot be split back into base + adapter, so a LoRA run
        # restarts from the base model and reloads its adapter (and base) from trainer.pt below.
        self.model = load_decoder(ckpt if ckpt and not lora else self.model_dir, torch.float32, device).train()
        self.ref_model = None
        if cfg.train.beta > 0:  # the reference is the initial policy: only loaded when the KL term is on
            self.ref_model = load_decoder(self.model_dir, torch.float32, device).eval().requires_grad_(False)
        self.dtypes = run_dtypes(cfg, device, ckpt_state.get("dtypes") if ckpt_state else None)
        print(f"[model] {self.model_dir.name} on {device}: rollout in {self.dtypes['rollout']}, update in "
              f"{self.dtypes['train']} (rollout.dtype={cfg.rollout.dtype}, train.dtype={cfg.train.dtype})",
              file=sys.stderr)
        # ---- rollout: a pool of workers, each with its own copy of the policy in the rollout dtype ----
        self.history = HistoryStore(max_rollouts=cfg.rollout.history_rollouts)  # the truth, checkpointed
        max_len = cfg.data.max_prompt_length + max(cfg.rollout.max_completion_length, cfg.val.max_completion_length) + 1
        check_context(self.model_dir, max_model_len=max_len - 1, num_slots=cfg.rollout.num_slots,
                      dtype=parse_dtype(self.dtypes["rollout"], device), device=device, slots_key="rollout.num_slots",
                      key=f"data.max_prompt_length ({cfg.data.max_prompt_length}) + the longest "
                          f"rollout/val.max_completion_length ({max_len - 1 - cfg.data.max_prompt_length})")
        worker = WorkerConfig(num_slots=cfg.rollout.num_slots, max_model_len=max_len, dtype=self.dtypes["rollout"],
                              speculative=cfg.rollout.speculative, max_draft_tokens=cfg.rollout.max_draft_tokens,
                              draft_rule=cfg.rollout.draft_rule, history_rollouts=cfg.rollout.history_rollouts,
                              admission=cfg.rollout.admission_order)
        # HistoSpec's learned state (checkpointed): a resumed worker reuses the saved cost model rather than
        # measuring a new one, and then takes the calibration, correction ratios and idle counters too.
        spec_states = read_spec_state(ckpt) if ckpt is not None else None
        if cost_model is not None and spec_states:  # a cost model given here wins over the saved one
            spec_states = [s and {k: v for k, v in s.items() if k not in ("cost", "correct_cost")} for s in spec_states]
        elif spec_states and spec_states[0] is not None and "cost" in spec_states[0]:
            cost_model = CostModel.from_dict(spec_states[0]["cost"])
        self.pool = make_pool(cfg.rollout.backend, cfg.rollout.num_workers, cfg.ray.address, self.model, self.tokenizer,
                              self.model_dir, worker, self.history, seed=cfg.run.seed, device=device,
                              cost_model=cost_model, max_worker_restarts=cfg.rollout.max_worker_restarts,
                              worker_timeout_s=cfg.rollout.worker_timeout_s, schedule=cfg.rollout.schedule,
                              migration=cfg.rollout.migration)
        if lora:
            add_lora(self.model, cfg.model.lora_r, cfg.model.lora_alpha, cfg.model.lora_dropout)

        # ---- data ----
        self.train_prompts, self.val_prompts, self.data_notes = load_prompts(cfg, self.tokenizer, cfg.run.seed)

        # ---- trainer, rewards ----
        # one_step_off trains on samples of the weights one update older: truncated importance sampling
        # corrects for that stale behaviour policy; in sync mode there is none to correct (see rl/trainer.py)
        one_step_off = cfg.rollout.mode == "one_step_off"
        self.trainer = PolicyTrainer(self.model, cfg.train, cfg.rollout.temperature, cfg.rollout.max_completion_length,
                                     self.ref_model, dtype=self.dtypes["train"],
                                     tis_imp_ratio_cap=cfg.train.tis_imp_ratio_cap if one_step_off else 0.0)
        # one_step_off: one driver thread rolls the next step out while this one trains (it only waits on Ray)
        self._background = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead") if one_step_off else None
        self._ahead: tuple[int, Future] | None = None  # (step, its rollout) started in the background
        fn = load_reward_function(cfg.reward.function) if cfg.reward.function else None
        self.scorer = RewardScorer(cfg.reward.format_weight, fn)
        self.reward_errors = 0

        if ckpt is not None:
            state, trainer_state, history_state = load_checkpoint(ckpt)
            try:  # a trainer state of another model or optimizer (e.g. model.lora_r changed by an override)
                if lora:
                    self.model.load_state_dict(trainer_state["lora_model"])
                self.trainer.load_state_dict(trainer_state)
                set_rng_state(trainer_state["rng"])
            except (KeyError, ValueError, TypeError, RuntimeError) as e:
                raise CheckpointError(f"{ckpt / 'trainer.pt'}: does not fit this run's model and optimizer "
                                      f"({type(e).__name__}: {str(e)[:200]}); was a model.* or train.* key changed "
                                      f"by an override on --resume?") from None
            if history_state is not None:
                try:
                    self.history.load_state_dict(history_state)
                except (KeyError, ValueError, TypeError) as e:
                    raise CheckpointError(f"{ckpt / 'history.json'}: not a history rhymerl wrote "
                                          f"({type(e).__name__}: {str(e)[:200]})") from None
            self.start_step = state["step"]
            self.reward_errors = state.get("reward_errors", 0)
            self.pool.load_weights(merged_parameters(self.model), version=self.start_step)
            if spec_states:
                self.pool.load_spec_state(spec_states)
            print(f"[train] resumed from {ckpt} at step {self.start_step} of {cfg.train.total_steps}", file=sys.stderr)
        save_config(cfg, self.run_dir / "config.yaml")
        self.logger = MetricsLogger(self.run_dir, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb,
                                    config=config_to_dict(cfg), resume_step=self.start_step if resume_dir else None)
        self.trace = TraceWriter(self.run_dir, resume_step=self.start_step if resume_dir else None)
        if ckpt is not None and not any(row["step"] == self.start_step for row in read_metrics(self.run_dir)):
            # Killed after the checkpoint was written but before its step's row was: the checkpoint keeps the
            # row (without timing_s/save and timing_s/step, measured after it), so no step goes missing.
            self.logger.log(self.start_step, state.get("metrics", {}))

    @classmethod
    def resume(cls, run_dir: str | Path, overrides: list[str] = (), **kw) -> "TrainingRun":
        """Continue the run in `run_dir` from its latest checkpoint, with its saved config (+ overrides)."""
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            raise CheckpointError(f"--resume {run_dir}: no such run directory")
        if latest_checkpoint(run_dir) is None:
            raise CheckpointError(f"--resume {run_dir}: no checkpoint in {run_dir / 'checkpoints'} (a run saves "
                                  f"one every run.save_every steps and at its end)")
        return cls(load_config(run_dir / "config.yaml", overrides), resume_dir=run_dir, **kw)

    # ---- one step ---------------------------------------------------------------------------------
    def _rollout(self, prompts: list[Prompt], n: int, params: SamplingParams, tag: str,
                 step: int | None = None) -> RolloutResult:
        """n responses per prompt; request ids (the keys of the random draws) are tag, prompt and generation.
        `step`: the training step as logged (from 1), for the workers' admission order; None for validation."""
        groups = [RolloutGroup(p.ids, [f"{tag}-p{i}-g{g}" for g in range(n)]) for i, p in enumerate(prompts)]
        result = self.pool.rollout(groups, params, step=step)
        bad = [o for o in result.outputs if o.finish_reason == "error"]
        if bad:
            raise RuntimeError(f"rollout request {bad[0].request_id} was rejected: {bad[0].error}")
        return result

    @staticmethod
    def _rollout_metrics(prefix: str, result: RolloutResult) -> dict:
        s = result.engine_totals()
        m = {f"{prefix}/tokens_per_s": s.generated_tokens / max(s.busy_s, 1e-9),
             f"{prefix}/tokens_per_forward": s.tokens_per_seq_forward,
             f"{prefix}/forward_passes": s.forward_passes,
             # prompt tokens computed, and those copied from a sequence holding the same prefix
             f"{prefix}/prefill_tokens": s.prompt_tokens, f"{prefix}/prefill_shared_tokens": s.shared_prompt_tokens,
             # requests moved between workers (rollout.migration) and their re-prefill's share of forward time
             f"{prefix}/migrations": s.migrations, f"{prefix}/migration_prefill_s": s.migration_prefill_s}
        sp = result.spec_totals()
        if sp is not None:
            m |= {f"{prefix}/spec_accept_rate": sp.accept_rate, f"{prefix}/spec_drafted": sp.drafted,
                  f"{prefix}/spec_accepted": sp.accepted, f"{prefix}/spec_mean_accepted_len": sp.mean_accepted_len,
                  f"{prefix}/draft_time_share": sp.draft_s / max(s.busy_s, 1e-9)}
            m |= {f"{prefix}/spec_accepted_{src}": v for src, v in sp.accepted_by_source.items()}
        return m | timeline_metrics(result, prefix)  # bubble ratio, finish gap, per worker, perf/throughput

    def _length_report(self, prompts: list[Prompt], group_lengths: list[list[int]]) -> dict:
        """HistoPipe's premise, "lengths rhyme", checked every step: the rank correlation between the mean
        length of each prompt's previous group (for this step's prompts that have one) and of its group now,
        and the share of prompts whose rank moved far. The previous rollout alone: in the default job the
        first epochs' responses hit the length cap, and a statistic over older rollouts tied every prompt."""
        seen = [i for i, p in enumerate(prompts) if p.ids in self.history]
        if len(seen) < 2:
            return {}
        predictor = LengthPredictor.from_history(self.history, [prompts[i].ids for i in seen], statistic="mean",
                                                 max_rollouts=1)
        predicted = predictor.predict_many([prompts[i].ids for i in seen])
        report = rank_report(predicted, [sum(group_lengths[i]) / len(group_lengths[i]) for i in seen])
        out = {"histopipe/prompts_with_history": len(seen), "histopipe/moved_far": report["moved_far"]}
        if report["rank_corr"] == report["rank_corr"]:  # NaN when every length ties
            out["histopipe/rank_corr"] = report["rank_corr"]
        return out

    def _step_prompts(self, step: int) -> list[Prompt]:
        """The prompts of step `step` (0-based): known in advance, a permutation keyed by (seed, epoch)."""
        cfg = self.cfg
        rows = batch_indices(step, len(self.train_prompts), cfg.train.prompts_per_step, cfg.run.seed, cfg.data.shuffle)
        return [self.train_prompts[i] for i in rows]

    def _train_params(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                              max_tokens=r.max_completion_length, seed=self.cfg.run.seed)

    def _train_rollout(self, step: int) -> RolloutResult:
        """Step `step`'s rollout (0-based) on the weights the pool holds now."""
        return self._rollout(self._step_prompts(step), self.cfg.rollout.num_generations, self._train_params(),
                             f"train-s{step}", step=step + 1)

    # ---- one_step_off: the next step's rollout in the background ------------------------------------
    def _rolls_ahead(self, step: int) -> bool:
        """Whether step `step`'s rollout starts in the background while step - 1 trains (one_step_off): not
        past the last step, and not for the step right after a checkpoint. A checkpoint holds its own step's
        weights only, so a run resumed there could not roll that step out on the weights one step older; that
        step rolls out synchronously in the uninterrupted run too, and resume stays exact."""
        cfg = self.cfg
        return (self._background is not None and step < cfg.train.total_steps
                and not (cfg.run.save_every > 0 and step % cfg.run.save_every == 0))

    def _start_ahead(self, step: int) -> None:
        """Start step `step`'s rollout in the background if it rolls ahead (after the history recorded the
        step before: its slices then hold what a synchronous rollout's would)."""
        if self._rolls_ahead(step):
            self._ahead = (step, self._background.submit(self._train_rollout, step))

    def _join_ahead(self) -> float:
        """Wait for the background rollout, if any (its error, if it failed, raises here); the seconds waited."""
        t0 = time.perf_counter()
        if self._ahead is not None:
            self._ahead[1].result()
        return time.perf_counter() - t0

    def _take_ahead(self, step: int) -> RolloutResult | None:
        """Step `step`'s rollout if it ran in the background (then joined), else None."""
        if self._ahead is None:
            return None
        ahead, future = self._ahead
        if ahead != step:
            raise RuntimeError(f"the background rollout is step {ahead}'s, but step {step} runs: one_step_off rolls "
                               f"out only the step after the one training")
        self._ahead = None
        return future.result()

    def train_step(self, step: int) -> dict:
        """Run step `step` (0-based) and return its metrics. In one_step_off its rollout ran in the background
        during the previous step's update (or runs now: the first step, the one after a checkpoint), and the
        next step's starts once this one's history is recorded."""
        cfg, r = self.cfg, self.cfg.rollout
        t0 = time.perf_counter()
        prompts = self._step_prompts(step)
        G = r.num_generations
        params = self._train_params()
        result = self._take_ahead(step)
        if result is None:  # sync mode, or a step that does not roll ahead
            result = self._train_rollout(step)
        outs = result.outputs
        t1 = time.perf_counter()
        examples = [p.example for p in prompts for _ in range(G)]
        scored = self.scorer.score([o.text for o in outs], examples)
        if scored.errors == len(outs):  # nothing to learn from: stop rather than train on zero rewards
            raise RewardFunctionError(f"step {step + 1}: the reward failed on every completion ({len(outs)}); "
                                      f"the first: {scored.error_messages[0]}")
        self.reward_errors += scored.errors
        for msg in scored.error_messages[:3]:
            tqdm.write(f"[reward] step {step}: {msg}", file=sys.stderr)
        rewards = torch.tensor(scored.rewards, dtype=torch.float32)  # [P*G]
        adv, adv_stats = grpo_advantages(rewards, G, cfg.train.scale_rewards)  # [P*G]
        group_lengths = [[len(o.token_ids) for o in outs[i * G : (i + 1) * G]] for i in range(len(prompts))]
        length_report = self._length_report(prompts, group_lengths)  # before the history learns this step
        self.trace.write(step + 1, [(prompt_key(p.ids), ls) for p, ls in zip(prompts, group_lengths)])
        append_timeline(self.run_dir, step + 1, result)  # RUN_DIR/timeline.jsonl (resumed runs: see its doc)
        for i, p in enumerate(prompts):  # the history store drafts next epoch's rollouts of these prompts
            group = outs[i * G : (i + 1) * G]
            self.pool.record(p.ids, [o.token_ids for o in group], scored.rewards[i * G : (i + 1) * G])
        self._start_ahead(step + 1)  # one_step_off: on the weights this step trains from, during its update
        t2 = time.perf_counter()
        samples = [Sample(prompts[k // G].ids, o.token_ids, o.logprobs, a, temperature=params.temperature)
                   for k, (o, a) in enumerate(zip(outs, adv.tolist()))]
        with deterministic_algorithms():
            metrics = self.trainer.update(samples)
        release_freed_memory()  # the backward pass's peak need not stay resident through the next rollout
        t3 = time.perf_counter()
        waited = self._join_ahead()  # before the weights change: a weight load never races a rollout
        t4 = time.perf_counter()
        self.pool.load_weights(merged_parameters(self.model), version=step + 1)
        t5 = time.perf_counter()

        lengths = torch.tensor([len(o.token_ids) for o in outs], dtype=torch.float32)
        metrics |= {
            "critic/rewards/mean": rewards.mean().item(), "critic/rewards/max": rewards.max().item(),
            "critic/rewards/min": rewards.min().item(),
            "critic/score/mean": sum(scored.correct) / len(outs),
            "critic/format/mean": sum(scored.formatted) / len(outs),
            "critic/advantages/max": adv.max().item(), "critic/advantages/min": adv.min().item(),
            "critic/zero_std_frac": adv_stats["zero_std_frac"],
            "response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
            "response_length/min": lengths.min().item(),
            "response_length/clip_ratio": sum(o.finish_reason == "length" for o in outs) / len(outs),
            "prompt_length/mean": sum(len(p.ids) for p in prompts) / len(prompts),
            "reward/errors": scored.errors, "reward/errors_total": self.reward_errors,
            "epoch": (step * cfg.train.prompts_per_step) // len(self.train_prompts),
            "history/tokens": self.history.size().get("tokens", 0),
            # 0 in sync mode; 1 in one_step_off for a step rolled out on the weights before the last update
            "rollout/staleness": step - result.weights_version,
            # the driver's time in each phase, adding up to the step: a rollout run in the background during the
            # previous step counts only as that step's rollout_wait (one_step_off), not as this one's rollout
            "timing_s/rollout": t1 - t0, "timing_s/reward": t2 - t1, "timing_s/update": t3 - t2,
            "timing_s/sync": t5 - t4,
        }
        if self._background is not None:  # how long the driver waited for the next step's rollout
            metrics["timing_s/rollout_wait"] = waited
        metrics |= self._rollout_metrics("rollout", result) | length_report
        return metrics

    def validate(self, step: int) -> dict:
        """Held-out prompts, one response each at `val.temperature` (greedy by default), HistoSpec as in rollout."""
        if not self.val_prompts:
            return {}
        t0 = time.perf_counter()
        v = self.cfg.val
        params = SamplingParams(temperature=v.temperature, max_tokens=v.max_completion_length, seed=self.cfg.run.seed)
        result = self._rollout(self.val_prompts, 1, params, f"val-s{step}")
        outs = result.outputs
        scored = self.scorer.score([o.text for o in outs], [p.example for p in self.val_prompts])
        for p, o, rew in zip(self.val_prompts, outs, scored.rewards):
            self.pool.record(p.ids, [o.token_ids], [rew])
        m = {"val/accuracy": sum(scored.correct) / len(outs), "val/reward/mean": sum(scored.rewards) / len(outs),
             "val/response_length/mean": sum(len(o.token_ids) for o in outs) / len(outs),
             "val/reward_errors": scored.errors}
        m |= self._rollout_metrics("val", result)
        m["timing_s/val"] = time.perf_counter() - t0
        return m

    def save(self, step: int, metrics: dict | None = None) -> Path:
        """Checkpoint after `step` completed steps; `metrics` is that step's row, kept for a resume."""
        trainer_state = self.trainer.state_dict()
        if self.cfg.model.lora_r > 0:  # base + adapters, for an exact resume (the HF weights are merged)
            trainer_state["lora_model"] = self.model.state_dict()
        return save_checkpoint(
            self.run_dir, step, hf_weights=to_hf_state_dict(self.model, merged_parameters(self.model)),
            model_dir=self.model_dir, trainer_state=trainer_state, history_state=self.history.state_dict(),
            state={"reward_errors": self.reward_errors, "config": config_to_dict(self.cfg), "dtypes": self.dtypes,
                   "metrics": {k: v if isinstance(v, str) else float(v) for k, v in (metrics or {}).items()}},
            keep=self.cfg.run.keep_checkpoints, spec_state=self.pool.spec_state())

    def run(self) -> Path:
        """Train from `start_step` to `train.total_steps`; returns the run directory."""
        cfg = self.cfg
        total = cfg.train.total_steps
        bar = tqdm(total=total, initial=self.start_step, desc="train", unit="step", disable=not cfg.run.progress,
                   dynamic_ncols=True)
        try:
            if self.start_step == 0:  # the starting point of the curves, and what the data loading skipped
                self.logger.log(0, (self.validate(0) if cfg.val.every > 0 else {}) | self.data_notes)
            for step in range(self.start_step, total):
                t0 = time.perf_counter()
                m = self.train_step(step)
                done = step + 1
                if cfg.val.every > 0 and (done % cfg.val.every == 0 or done == total):
                    m |= self.validate(done)
                if done == total or (cfg.run.save_every > 0 and done % cfg.run.save_every == 0):
                    t1 = time.perf_counter()
                    self.save(done, m)
                    m["timing_s/save"] = time.perf_counter() - t1
                m["timing_s/step"] = time.perf_counter() - t0
                self.logger.log(done, m)
                bar.update(1)
                bar.set_postfix(reward=f"{m['critic/rewards/mean']:.3f}", acc=f"{m['critic/score/mean']:.2f}",
                                tok_s=f"{m['rollout/tokens_per_s']:.0f}",
                                accept=f"{m.get('rollout/spec_accept_rate', 0):.2f}")
        finally:
            if self._background is not None:  # a failed step may leave the next one's rollout running
                self._background.shutdown(wait=True)
            bar.close()
            self.logger.close()
        return self.run_dir
