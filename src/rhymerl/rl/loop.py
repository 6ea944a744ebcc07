"""The RL loop (docs/design.md, section 4): per step, prompts -> rollout (a `rhymerl.rollout` pool) -> rewards ->
advantages -> update -> weight sync -> history record; validation every `val.every` steps, checkpoints every
`run.save_every`. The loop owns the history store (the truth, checkpointed) and reaches rollout workers only
through the pool, never an engine.

The run is a pure function of config and seed: step t's prompts come from a permutation keyed by (seed,
epoch), every sampled token from randomness keyed by (seed, request id, position), a request id being
(step, prompt, generation); so a resumed run repeats the uninterrupted one exactly, and HistoSpec on or off
gives the same rollouts (up to bf16 rounding).

`rollout.mode=one_step_off` (Ray workers, docs/design.md section 4): step t+1 rolls out on the weights step t
trains from, in a driver thread (`rl/background_rollout.py`) or, with `rollout.stream`, queued on each worker
behind its share of t (`rl/streamed_rollout.py`); `rollout.defer_tail` continues a step's tail in the next step
and trains a group where it completes (`rl/group_assembly.py`). Each token's policy version comes back with it;
no token is trained more than `rollout.max_staleness` versions after the weights that sampled it.

`train.filter_groups` (DAPO's dynamic sampling, `rl/filtering.py`; sync only): a step draws batches until it
holds prompts_per_step groups of unequal rewards; the data position, then ahead of the step, is checkpointed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from rhymerl.config import ConfigError, TrainConfig, config_to_dict, load_config
from rhymerl.cost_model import CostModel
from rhymerl.histopipe.trace import TraceWriter
from rhymerl.history import HistoryStore, prompt_key
from rhymerl.metrics import MetricsLogger, read_metrics
from rhymerl.model.fetch import resolve_model_dir
from rhymerl.model.weights import load_decoder, to_hf_state_dict
from rhymerl.rl.advantages import grpo_advantages
from rhymerl.rl.checkpoint import check_checkpoint, latest_checkpoint, save_checkpoint
from rhymerl.rl.resume import check_resume_dir, check_total_steps, restore_training, resume_spec_state
from rhymerl.rl.lora import add_lora, merged_parameters
from rhymerl.rl.prompts import Prompt, batch_indices, load_prompts
from rhymerl.rl.background_rollout import BackgroundRollout
from rhymerl.rl.streamed_rollout import StreamedRollout
from rhymerl.rl.filtering import GroupFilter
from rhymerl.rl.group_assembly import GroupAssembly
from rhymerl.rl.rewards import RewardBatch, RewardFunctionError, RewardScorer
from rhymerl.rl.run_dir import CONFIG, claim, new_run_dir, record_overrides, recorded_overrides
from rhymerl.rl.run_settings import resolve_machine_defaults, run_dtypes, worker_config
from rhymerl.rl.step_metrics import (finished, group_metrics, length_report, merged, rollout_metrics, staleness_metrics,
                                     val_metrics)
from rhymerl.process import deterministic_algorithms, release_freed_memory, setup_process
from rhymerl.rl.trainer import PolicyTrainer, Sample
from rhymerl.rollout import RolloutGroup, RolloutResult, SamplingParams
from rhymerl.rollout.factory import make_pool, make_stream
from rhymerl.rollout.timeline import append_timeline


class TrainingRun:
    """One `rhymerl train` run. `cost_model` fixes HistoSpec's forward-cost model instead of measuring it
    (tests use it to make draft shapes, and so bf16 rounding, independent of timing)."""

    def __init__(self, cfg: TrainConfig, resume_dir: str | Path | None = None, cost_model: CostModel | None = None,
                 resume_overrides: Sequence[str] = ()):
        if cfg.train.world_size > 1 and cfg.model.lora_r > 0:
            raise ConfigError("model.lora_r > 0 with train.world_size > 1: LoRA runs in one process for now "
                              "(set train.world_size=1)")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        setup_process(cfg.run.seed, device)
        # a fresh run gets a directory no other run holds (rl/run_dir.py); a resumed one keeps its own
        self.run_dir = Path(resume_dir) if resume_dir else new_run_dir(cfg.run.output_dir)
        ckpt = latest_checkpoint(self.run_dir) if resume_dir else None
        ckpt_state = check_checkpoint(ckpt) if ckpt is not None else None
        self.dtypes = run_dtypes(cfg, device, ckpt_state.get("dtypes") if ckpt_state else None)
        # from here on the config says what runs: the dtypes, and the default batch for this machine
        self.cfg = cfg = resolve_machine_defaults(cfg, self.dtypes)
        if ckpt is not None:
            check_total_steps(ckpt, ckpt_state, cfg.train.total_steps)

        # ---- model: fp32 master weights for the trainer (each rollout worker keeps a copy in its dtype) ----
        self.model_dir = resolve_model_dir(cfg.model.name)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        lora = cfg.model.lora_r > 0
        # With LoRA the checkpoint's merged weights cannot be split back into base + adapter, so a LoRA run
        # restarts from the base model and reloads its adapter (and base) from trainer.pt below.
        self.model = load_decoder(ckpt if ckpt and not lora else self.model_dir, torch.float32, device).train()
        self.ref_model = (load_decoder(self.model_dir, torch.float32, device).eval().requires_grad_(False)
                          if cfg.train.beta > 0 else None)  # the initial policy: loaded only for the KL term
        print(f"[model] {self.model_dir.name} on {device}: rollout in {self.dtypes['rollout']}, update in "
              f"{self.dtypes['train']}; {cfg.train.total_steps} steps of {cfg.train.prompts_per_step} prompts x "
              f"{cfg.rollout.num_generations}", file=sys.stderr)
        # ---- rollout: a pool of workers, each with its own copy of the policy in the rollout dtype ----
        self.history = HistoryStore(max_rollouts=cfg.rollout.history_rollouts)  # the truth, checkpointed
        spec_states, cost_model = resume_spec_state(ckpt, cost_model)  # HistoSpec's learned state, checkpointed
        self.pool = make_pool(worker_config(cfg, self.model_dir, device), cfg.ray.address, self.model, self.tokenizer,
                              self.model_dir, self.history, seed=cfg.run.seed, device=device, cost_model=cost_model)
        if lora:  # after make_pool, which copies the plain Decoder (it refuses one with adapters)
            add_lora(self.model, cfg.model.lora_r, cfg.model.lora_alpha, cfg.model.lora_dropout)
        # ---- data, trainer, rewards ----
        self.train_prompts, self.val_prompts, self.data_notes = load_prompts(cfg, self.tokenizer, cfg.run.seed)
        # one_step_off trains on samples of the weights one update older: truncated importance sampling
        # corrects for that stale behaviour policy; in sync mode there is none to correct (see rl/trainer.py)
        one_step_off = cfg.rollout.mode == "one_step_off"
        trainer_args = (self.model, cfg.train, cfg.rollout.temperature, cfg.rollout.max_completion_length,
                        self.ref_model)
        trainer_kw = {"dtype": self.dtypes["train"],
                      "tis_imp_ratio_cap": cfg.train.tis_imp_ratio_cap if one_step_off else 0.0}
        if cfg.train.world_size > 1:  # ranks: local processes, Ray actors or torchrun's; self.model their mirror
            from rhymerl.rl.rank_groups import rank_group  # torch.distributed's imports, only when ranks are asked for
            self.trainer = rank_group(cfg.rollout.backend, *trainer_args, **trainer_kw, seed=cfg.run.seed)
        else:
            self.trainer = PolicyTrainer(*trainer_args, **trainer_kw)
        # one_step_off: one driver thread rolls the next step out while this one trains (it only waits on Ray);
        # with rollout.stream the workers queue the next step behind this one instead
        self.stream = StreamedRollout(make_stream(self.pool, cfg.rollout.max_staleness), self._request,
                                      cfg.train.total_steps, cfg.run.save_every,
                                      cfg.rollout.defer_tail) if cfg.rollout.stream else None
        self.assembly = GroupAssembly()  # rollout.defer_tail: groups waiting for a deferred request
        self.ahead = BackgroundRollout(one_step_off and self.stream is None, cfg.train.total_steps, cfg.run.save_every)
        self.scorer = RewardScorer.from_config(cfg.reward, cfg.rollout.max_completion_length)
        self.start_step, self.reward_errors = 0, 0
        self.data_pos = 0  # batches of prompts drawn so far: the step, unless dynamic sampling drew more
        if ckpt is not None:
            state = restore_training(ckpt, self.trainer, self.history, lora_model=self.model if lora else None)
            self.start_step, self.reward_errors = state["step"], state.get("reward_errors", 0)
            self.data_pos = state.get("data_pos", self.start_step)
            self.pool.load_weights(merged_parameters(self.model), version=self.start_step)
            if spec_states:
                self.pool.load_spec_state(spec_states)
            print(f"[train] resumed from {ckpt} at step {self.start_step} of {cfg.train.total_steps}", file=sys.stderr)
        if ckpt is None:  # config.yaml says what ran: written once, by the run that claims the directory
            claim(self.run_dir, cfg)
        else:  # kept as the run started; the resume's overrides are recorded beside it
            record_overrides(self.run_dir, self.start_step, resume_overrides)
        self.logger = MetricsLogger(self.run_dir, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb,
                                    config=config_to_dict(cfg), resume_step=self.start_step if resume_dir else None)
        self.trace = TraceWriter(self.run_dir, resume_step=self.start_step if resume_dir else None)
        if ckpt is not None and not any(row["step"] == self.start_step for row in read_metrics(self.run_dir)):
            # Killed after the checkpoint was written but before its step's row was: the checkpoint keeps the
            # row (without timing_s/save and timing_s/step, measured after it), so no step goes missing.
            self.logger.log(self.start_step, state.get("metrics", {}))

    @classmethod
    def resume(cls, run_dir: str | Path, overrides: Sequence[str] = (), **kw) -> "TrainingRun":
        """Continue the run in `run_dir` from its latest checkpoint, with its saved config, the overrides of
        its earlier resumes and then `overrides` (recorded in its overrides.jsonl: rl/run_dir.py)."""
        run_dir = check_resume_dir(run_dir)
        cfg = load_config(run_dir / CONFIG, recorded_overrides(run_dir) + list(overrides))
        return cls(cfg, resume_dir=run_dir, resume_overrides=overrides, **kw)

    def _rollout(self, prompts: list[Prompt], n: int, params: SamplingParams, tag: str,
                 step: int | None = None) -> RolloutResult:
        """n responses per prompt; request ids (the keys of the random draws) are tag, prompt and generation.
        `step`: the training step as logged (from 1), for the workers' admission order; None for validation."""
        groups = self._groups(prompts, n, tag)
        result = (self.stream or self.pool).rollout(groups, params, step=step)
        bad = [o for o in result.outputs if o.finish_reason == "error"]
        if bad:
            raise RuntimeError(f"rollout request {bad[0].request_id} was rejected: {bad[0].error}")
        return result

    @staticmethod
    def _groups(prompts: list[Prompt], n: int, tag: str) -> list[RolloutGroup]:
        return [RolloutGroup(p.ids, [f"{tag}-p{i}-g{g}" for g in range(n)]) for i, p in enumerate(prompts)]

    def _request(self, step: int) -> tuple[list[RolloutGroup], SamplingParams, int]:
        """Training step `step`'s rollout (0-based; one_step_off draws one batch a step, so its data position
        is the step): groups, params and the step number as logged, for `StreamedRollout`."""
        return (self._groups(self._prompts_at(step), self.cfg.rollout.num_generations, f"train-s{step}"),
                self._train_params(), step + 1)

    def _prompts_at(self, pos: int) -> list[Prompt]:
        """The prompts at data position `pos` (one batch of prompts_per_step): known in advance, a
        permutation keyed by (seed, epoch). Without dynamic sampling the position is the step."""
        cfg = self.cfg
        rows = batch_indices(pos, len(self.train_prompts), cfg.train.prompts_per_step, cfg.run.seed, cfg.data.shuffle)
        return [self.train_prompts[i] for i in rows]

    def _train_params(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                              max_tokens=r.max_completion_length, seed=self.cfg.run.seed)

    def _draw(self, step: int, k: int) -> tuple[list[Prompt], list, RolloutResult, RewardBatch]:
        """Step `step`'s k-th rollout (k > 0: dynamic sampling) of the next batch of prompts, scored; request ids
        train-s{step} (k = 0) or train-s{step}-d{k}. The first may have run in the background (one_step_off).
        Returns the groups complete now (`rollout.defer_tail`: earlier steps' too, this step's deferred wait):
        their prompts and outputs (siblings in order), the result and the scores."""
        prompts = self._prompts_at(self.data_pos)
        self.data_pos += 1
        G, tag = self.cfg.rollout.num_generations, f"train-s{step}" + (f"-d{k}" if k else "")
        result = None if k else self.stream.take(step) if self.stream else self.ahead.take(step)
        if result is None:  # sync mode, a step that does not roll ahead, or a further draw
            result = self._rollout(prompts, G, self._train_params(), tag, step=step + 1)
        prompts, grouped = self.assembly.take(prompts, self._groups(prompts, G, tag), result)
        outs = [o for g in grouped for o in g]
        t0 = time.perf_counter()
        scored = self.scorer.score([o.text for o in outs], [p.example for p in prompts for _ in range(G)],
                                   lengths=[len(o.token_ids) for o in outs],
                                   finished=finished(outs))
        if outs and scored.errors == len(outs):  # nothing to learn from: stop rather than train on zero rewards
            raise RewardFunctionError(f"step {step + 1}: the reward failed on every completion ({len(outs)}); "
                                      f"the first: {scored.error_messages[0]}")
        self.reward_errors += scored.errors
        for msg in scored.error_messages[:3]:
            tqdm.write(f"[reward] step {step}: {msg}", file=sys.stderr)
        self.reward_s += time.perf_counter() - t0
        return prompts, outs, result, scored

    def train_step(self, step: int) -> dict:
        """Run step `step` (0-based) and return its metrics: rollout (with `train.filter_groups`, more until
        prompts_per_step groups with unequal rewards are kept), rewards, advantages, update, weight sync. In
        one_step_off the rollout ran during the previous step's update (or runs now: the first step, the one
        after a checkpoint), and the next step's starts once this one's history is recorded."""
        cfg, G = self.cfg, self.cfg.rollout.num_generations
        t0, self.reward_s = time.perf_counter(), 0.0  # reward_s: scoring time, summed by _draw
        kept = GroupFilter(cfg.train.prompts_per_step, G, cfg.train.max_num_gen_batches)
        results, rhyme, traced, errors, timeouts = [], {}, [], 0, 0  # rhyme: the step's `length_report`
        while True:
            prompts, outs, result, scored = self._draw(step, len(results))
            results.append(result)
            errors, timeouts = errors + scored.errors, timeouts + scored.timeouts
            groups = [(p, outs[i * G:(i + 1) * G], scored.rewards[i * G:(i + 1) * G],
                       scored.correct[i * G:(i + 1) * G], scored.formatted[i * G:(i + 1) * G])
                      for i, p in enumerate(prompts)]
            lengths = [[len(o.token_ids) for o in outs] for _, outs, *_ in groups]
            if not rhyme:  # before the history learns this step
                rhyme = length_report(self.history, [p.ids for p in prompts], lengths,
                                      cap=cfg.rollout.max_completion_length)
            traced += [(prompt_key(p.ids), ls) for p, ls in zip(prompts, lengths)]
            for p, outs, rewards, *_ in groups:  # the history store drafts next epoch's rollouts of these prompts
                self.pool.record(p.ids, [o.token_ids for o in outs], rewards)
            if not cfg.train.filter_groups:
                kept.kept = groups
                break
            kept.add(groups, scored.rewards)
            if not kept.wants_more():
                break
        train_groups = kept.kept or groups  # no group of unequal rewards: the last draw's (zero advantages)
        result = merged(results)
        self.trace.write(step + 1, traced)
        append_timeline(self.run_dir, step + 1, result)  # RUN_DIR/timeline.jsonl (resumed runs: see its doc)
        # one_step_off (dynamic sampling is off there): on the weights this step trains from, during its update
        self.ahead.start(step + 1, lambda: self._rollout(self._prompts_at(self.data_pos), G, self._train_params(),
                                                         f"train-s{step + 1}", step=step + 2))
        t1 = time.perf_counter()
        rewards = torch.tensor([x for g in train_groups for x in g[2]], dtype=torch.float32)  # [P*G]
        adv, adv_stats = grpo_advantages(rewards, G, cfg.train.scale_rewards)  # [P*G]
        samples = [Sample(p.ids, o.token_ids, o.logprobs, a, temperature=cfg.rollout.temperature)
                   for (p, outs, *_), a_group in zip(train_groups, adv.view(-1, G).tolist())
                   for o, a in zip(outs, a_group)]
        with deterministic_algorithms():
            metrics = self.trainer.update(samples)
        release_freed_memory()  # the backward pass's peak need not stay resident through the next rollout
        t2 = time.perf_counter()
        waited = self.ahead.join()  # before the weights change: a weight load never races a rollout
        t3 = time.perf_counter()
        (self.stream or self.pool).load_weights(merged_parameters(self.model), version=step + 1)
        t4 = time.perf_counter()
        metrics |= group_metrics(train_groups, rewards, adv) | {
            "critic/zero_std_frac": adv_stats["zero_std_frac"],
            "reward/errors": errors, "reward/errors_total": self.reward_errors, "reward/timeouts": timeouts,
            "epoch": ((self.data_pos - 1) * cfg.train.prompts_per_step) // len(self.train_prompts),
            "history/tokens": self.history.size().get("tokens", 0), "train/groups": len(train_groups),
            # 0 in sync mode; 1 in one_step_off for a step rolled out on the weights before the last update
            "rollout/staleness": step - results[0].weights_version,
            # the driver's time per phase, adding up to the step: a rollout run in the background during the
            # previous step counts as that step's rollout_wait (one_step_off), not as this one's rollout
            "timing_s/rollout": t1 - t0 - self.reward_s, "timing_s/reward": self.reward_s,
            "timing_s/update": t2 - t1, "timing_s/sync": t4 - t3,
        }
        if cfg.train.filter_groups:
            metrics |= kept.metrics()
        if self.ahead.enabled:  # how long the driver waited for the next step's rollout
            metrics["timing_s/rollout_wait"] = waited
        metrics |= scored.metrics() | rollout_metrics("rollout", result) | rhyme
        metrics |= staleness_metrics(step, [o for _, outs, *_ in train_groups for o in outs], result,
                                     cfg.rollout.max_staleness)
        metrics["reward/timeouts"] = timeouts  # over every draw of the step (scored.metrics has the last one's)
        return metrics

    def validate(self, step: int) -> dict:
        """Held-out prompts, one response each at `val.temperature` (greedy by default), HistoSpec as in rollout."""
        if not self.val_prompts:
            return {}
        t0 = time.perf_counter()
        v = self.cfg.val
        params = SamplingParams(temperature=v.temperature, max_tokens=v.max_completion_length, seed=self.cfg.run.seed)
        result = self._rollout(self.val_prompts, 1, params, f"val-s{step}")
        scored = self.scorer.score([o.text for o in result.outputs], [p.example for p in self.val_prompts],
                                   finished=finished(result.outputs))
        for p, o, rew in zip(self.val_prompts, result.outputs, scored.rewards):
            self.pool.record(p.ids, [o.token_ids], [rew])
        m = val_metrics(scored, result)
        m["timing_s/val"] = time.perf_counter() - t0
        return m

    def save(self, step: int, metrics: dict | None = None) -> Path:
        """Checkpoint after `step` completed steps; `metrics` is that step's row, kept for a resume."""
        if self.assembly.waiting:  # a step that ends in a checkpoint defers nothing (StreamedRollout.defers)
            raise RuntimeError(f"checkpoint {step}: {len(self.assembly.waiting)} groups still wait for a deferred "
                               f"request (a step that ends in a checkpoint must defer nothing)")
        trainer_state = self.trainer.state_dict()
        if self.cfg.model.lora_r > 0:  # base + adapters, for an exact resume (the HF weights are merged)
            trainer_state["lora_model"] = self.model.state_dict()
        return save_checkpoint(
            self.run_dir, step, hf_weights=to_hf_state_dict(self.model, merged_parameters(self.model)),
            model_dir=self.model_dir, trainer_state=trainer_state, history_state=self.history.state_dict(),
            state={"reward_errors": self.reward_errors, "data_pos": self.data_pos, "config": config_to_dict(self.cfg),
                   "dtypes": self.dtypes,
                   "metrics": {k: v if isinstance(v, str) else float(v) for k, v in (metrics or {}).items()}},
            keep=self.cfg.run.keep_checkpoints, spec_state=self.pool.spec_state())

    def run(self) -> Path:
        """Train from `start_step` to `train.total_steps`; returns the run directory. Ends the rollout pool's
        workers either way (a Ray pool's actors; a local pool's worker stays readable)."""
        cfg, total = self.cfg, self.cfg.train.total_steps
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
            self.ahead.close()  # a failed step may leave the next one's rollout running
            self.pool.close()  # a Ray pool's actors would hold the cluster's CPUs and memory past the run
            self.trainer.close()  # several ranks: stop their processes
            self.scorer.close()
            bar.close()
            self.logger.close()
        return self.run_dir
