"""The schema of `rhymerl train`'s config: one dataclass per section, each field with its help text, allowed values
and range in its metadata, and each section validating itself (`validate` checks a whole `TrainConfig`).

The dataclass defaults are the first layer of a config (they run the embedded arithmetic job on smollm2-135m);
`rhymerl.config.loading` merges YAML files and overrides into them. The field machinery (a field's metadata,
the per-field checks) is `rhymerl.config.fields`. No torch here (see `rhymerl.config`).
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass, field, fields

from rhymerl.config.fields import ConfigError, field_errors, must_be
from rhymerl.config.fields import option as _opt
from rhymerl.data.dataset import BUILTIN_TASKS  # torch-free, like this module and the three below
from rhymerl.histopipe.fleet import POOL_MIGRATIONS
from rhymerl.histopipe.stream_fleet import STREAM_MIGRATIONS
from rhymerl.histopipe.plan import ADMISSION_ORDERS
from rhymerl.histopipe.plan import SCHEDULES as ROLLOUT_SCHEDULES
from rhymerl.histospec.budget import DRAFT_RULES
from rhymerl.histospec.speculator import SPECULATIVE_MODES

__all__ = [
    "ADMISSION_ORDERS", "BUILTIN_TASKS", "DRAFT_RULES", "DTYPES", "LOSS_TYPES", "LR_SCHEDULERS",
    "ROLLOUT_BACKENDS", "ROLLOUT_MODES", "ROLLOUT_SCHEDULES", "SCALE_REWARDS", "SPECULATIVE_MODES", "ConfigError",
    "DataSection", "ModelSection", "RaySection", "RewardSection", "RolloutSection", "RunSection", "TrainConfig",
    "TrainSection", "ValSection", "validate",
]

# Allowed values of the enum-like string fields (the sections check them), each list written once: the
# torch-free modules that implement an option own its list and this module imports it (above); the lists of
# options implemented by torch modules are owned here, and those modules import them from here.
DTYPES = ("auto", "bf16", "fp32")
LR_SCHEDULERS = ("constant", "linear", "cosine")
LOSS_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo")  # rhymerl.rl.losses.policy_loss
SCALE_REWARDS = ("group", "batch", "none")  # rhymerl.rl.advantages.grpo_advantages
ROLLOUT_BACKENDS = ("local", "ray")  # rhymerl.rollout.factory.make_pool builds each
ROLLOUT_MODES = ("sync", "one_step_off")  # rhymerl.rl.loop.TrainingRun runs each


class _Section:
    """A config section; it validates itself: types, finite numbers, then choices, ranges and its `_rules`."""

    def _rules(self) -> list[tuple]:
        """(field, holds, rule[, note]) checks beyond one field's range; run once the types are right."""
        return []

    def validate(self) -> list[str]:
        """Every invalid value of this section, one line each naming its key; [] when valid."""
        section = _SECTION_NAMES[type(self)]  # its field name in TrainConfig (below)
        errors, typed = field_errors(section, self, _TYPES[section])
        if not typed:
            return errors
        return errors + [must_be(section, self, name, rule, *note)
                         for name, holds, rule, *note in self._rules() if not holds]


# ---------------------------------------------------------------- sections


@dataclass
class ModelSection(_Section):
    """The policy model and how it is fine-tuned."""

    name: str = _opt("smollm2-135m", "built-in name, HF model dir, .gguf file or hub id")
    lora_r: int = _opt(0, "0 = full fine-tuning; >0 = LoRA rank (via peft)", check=">= 0")
    lora_alpha: int = _opt(32, "LoRA alpha (scale = alpha / r)", check="> 0")
    lora_dropout: float = _opt(0.0, "LoRA dropout, in [0, 1)", check="in [0, 1)")

    def _rules(self) -> list[tuple]:
        return [("name", self.name.strip() != "", "non-empty")]


@dataclass
class DataSection(_Section):
    """Training and validation prompts."""

    task: str = _opt("arithmetic", "built-in task, used when train_files is empty", BUILTIN_TASKS)
    train_files: str = _opt("", "JSONL or Parquet path (GSM8K or verl layout); empty = the built-in task")
    val_files: str = _opt("", "same layout; empty = held-out prompts of the built-in task, or none")
    num_train_prompts: int = _opt(32, "size of the fixed built-in prompt set (prompts recur every epoch)",
                                  check=">= 1")
    num_val_prompts: int = _opt(16, "number of built-in held-out prompts (0 = none)", check=">= 0")
    max_prompt_length: int = _opt(256, "tokens; longer prompts are skipped and counted", check=">= 1")
    skip_malformed: bool = _opt(False, "skip and count malformed dataset rows instead of failing")
    shuffle: bool = _opt(True, "shuffle the prompts every epoch")


@dataclass
class RewardSection(_Section):
    """How completions are scored."""

    format_weight: float = _opt(0.2, "weight of the format reward added to correctness", check=">= 0")
    function: str = _opt("", "user reward 'module:function' or 'path/to/file.py:function'; "
                              "replaces the built-in scorer (one entry of reward.functions)")
    # Tuples, not lists: a dataclass default must be immutable; YAML and overrides write lists ([a, b]).
    functions: tuple[str, ...] = _opt((), "several user rewards (TRL's reward_funcs), a list of "
                                      "'module:function' / 'path/to/file.py:function'; correctness is their "
                                      "weighted sum (instead of reward.function)")
    weights: tuple[float, ...] = _opt((), "weight of each of reward.functions (TRL's reward_weights); "
                                      "empty = 1 each")
    # 60 s: a hung function stops costing time after one call's worth (its worker process is killed), while an
    # answer checker with math_verify's own 5 s limits, or a judge behind an HTTP call, fits easily.
    timeout_s: float = _opt(60.0, "seconds a user reward function may take per completion; one that does not "
                            "return scores 0 and counts in reward/errors (the functions then run in a worker "
                            "process, restarted after a timeout); 0 = no limit, called in this process",
                            check=">= 0")
    overlong_buffer_len: int = _opt(0, "DAPO's overlong penalty (verl's reward_model.overlong_buffer.len): a "
                                    "response longer than rollout.max_completion_length minus this many tokens "
                                    "loses up to overlong_penalty_factor, linearly; 0 = off", check=">= 0")
    overlong_penalty_factor: float = _opt(1.0, "the overlong penalty at max_completion_length (verl's "
                                          "overlong_buffer.penalty_factor)", check=">= 0")

    def _rules(self) -> list[tuple]:
        def spec_ok(spec: str) -> bool:
            module, _, func = spec.rpartition(":")
            return bool(module) and func.isidentifier()

        n = len(self.functions) or bool(self.function)
        return [("function", not self.function or spec_ok(self.function),
                 "'module:function' or 'path/to/file.py:function'"),
                ("functions", all(map(spec_ok, self.functions)),
                 "a list of 'module:function' or 'path/to/file.py:function'"),
                ("functions", not (self.function and self.functions), "empty when reward.function is set",
                 " (reward.function is one entry of reward.functions: set one of the two)"),
                ("weights", not self.weights or len(self.weights) == n,
                 f"empty or one weight per reward function ({int(n)})")]


@dataclass
class RolloutSection(_Section):
    """Generation of the completions (the rollout engine)."""

    num_generations: int = _opt(8, "completions per prompt (the GRPO group size, >= 2)")
    max_completion_length: int = _opt(128, "max new tokens per completion", check=">= 1")
    temperature: float = _opt(1.0, "sampling temperature (0 = greedy)", check=">= 0")
    top_p: float = _opt(1.0, "nucleus sampling, in (0, 1]", check="in (0, 1]")
    top_k: int = _opt(0, "top-k sampling (0 = off)", check=">= 0")
    speculative: str = _opt("histospec", "speculative decoding from past rollouts", SPECULATIVE_MODES)
    num_slots: int = _opt(32, "sequences decoded concurrently by the engine", check=">= 1")
    dtype: str = _opt("auto", "rollout engine weights; auto = bf16 where the device has native bf16 matmuls "
                      "(CUDA, CPUs with AVX-512 or AMX), else fp32", DTYPES)
    history_rollouts: int = _opt(4, "rollouts kept per prompt by the history store (drafting source)",
                                 check=">= 1")
    max_draft_tokens: int = _opt(0, "longest draft proposed per sequence and step; 0 = by the machine: 32 where "
                                 "the rollout runs in bf16, 4 in fp32 (where a verification row costs about what a "
                                 "decode row does)", check=">= 0")
    draft_rule: str = _opt("cost", "per-sequence draft length: cost = full trees, the step budget alone decides; "
                           "aimd = the paper's +2 / back to 2; doubling = x2 / halve", DRAFT_RULES)
    backend: str = _opt("local", "where rollout workers run: local = one worker in this process, no services; "
                        "ray = one Ray actor per worker (see the ray section)", ROLLOUT_BACKENDS)
    num_workers: int = _opt(1, "rollout workers, each an engine with its HistoSpec state (> 1 needs "
                            "backend=ray); the CPU cores are divided among them, on CUDA each takes one GPU",
                            check=">= 1")
    max_worker_restarts: int = _opt(3, "times a failed rollout worker is restarted and its requests run again "
                                    "(its rollout raised or, with ray, its actor died or did not answer); past it "
                                    "the worker is dropped and the others take its requests, and with none left "
                                    "the run stops", check=">= 0")
    worker_timeout_s: float = _opt(0.0, "backend=ray: seconds a worker's share of a rollout, or a weight load, "
                                   "may take before the worker counts as failed (0 = no limit)", check=">= 0")
    admission_order: str = _opt("fifo", "order in which a worker's groups enter its slots: fifo = as given; "
                                "longest_first = longest predicted length first, from the history (HistoPipe "
                                "inside a worker; the same tokens, other timing); alternate = shortest first on "
                                "odd steps, longest first on even ones (for mode=one_step_off)", ADMISSION_ORDERS)
    # static and off until `rhymerl bench pipe`'s two-worker runs show histopipe / migration ahead
    schedule: str = _opt("static", "backend=ray: how a step's groups are split among the workers (a group stays "
                         "on one worker): static = equal contiguous shares (verl); least_loaded = request counts "
                         "balanced (OpenRLHF/slime); histopipe = predicted lengths from the history, balanced on "
                         "the measured cost model, longest first. The same tokens under each; default static "
                         "until histopipe is measured to win", ROLLOUT_SCHEDULES)
    migration: bool = _opt(False, "backend=ray: a worker that has finished its share takes requests of one still "
                           "running at its next step boundary (re-prefilled; the same tokens); with stream=true, "
                           "from the oldest step still running; off until measured to win")
    migration_rule: str = _opt("half_busiest", "migration=true: which requests move. half_busiest = half the "
                               "busiest worker's unfinished (waiting first); tail = the paper's: one running request "
                               "at a time, in its group's last 10% unfinished, grown past 1.2x its group's predicted "
                               "longest; remaining = most predicted work left, from the worker with most, while it "
                               "pays; remaining+early = that, one per group admitted first, outgrown siblings next",
                               POOL_MIGRATIONS)
    tier2: bool = _opt(False, "schedule=histopipe: a group predicted long enough to hold the step back may be "
                       "split over several workers (HistoPipe's tier 2; siblings on one worker still draft from "
                       "each other). The same tokens; off until measured to win")
    mode: str = _opt("sync", "sync = each step rolls out on the weights it trains; one_step_off = step t+1 rolls "
                     "out on the workers while step t trains, on weights one step old (backend=ray; not strictly "
                     "on-policy: see train.tis_imp_ratio_cap)", ROLLOUT_MODES)
    stream: bool = _opt(False, "mode=one_step_off: rollout as a stream, each worker's share of step t+1 queued "
                        "behind its share of step t, so that a worker done with step t starts step t+1 at once "
                        "(on the same weights, the same tokens); off = step t+1 starts when all of step t is in")
    defer_tail: bool = _opt(False, "stream=true: a step's tail requests (the last 10% of a group's unfinished, "
                            "grown past 1.2x the history's predicted longest) stop and continue first in their "
                            "worker's share of the next step, re-prefilled; their group trains at the step where "
                            "it completes (within max_staleness, else run again from scratch)")
    max_staleness: int = _opt(1, "no token is trained more than this many weight versions after the weights that "
                              "sampled it (0 in sync, 1 in one_step_off; a deferred request that would exceed it "
                              "is run again from scratch, rollout/rerun)", check=">= 0")
    reward_aware_drafting: bool = _opt(False, "HistoSpec prefers branches that earlier responses with higher "
                                       "rewards took (the paper's reward-aware priority); same tokens, other drafts")

    def _rules(self) -> list[tuple]:
        return [("num_generations", self.num_generations >= 2, ">= 2",
                 " (GRPO compares completions of one prompt: a group of 1 has zero advantage)"),
                ("num_workers", self.backend != "local" or self.num_workers == 1, "1 with rollout.backend=local",
                 " (the local backend runs one in-process worker; set rollout.backend=ray for several)"),
                ("mode", self.backend != "local" or self.mode == "sync", "'sync' with rollout.backend=local",
                 " (one_step_off rolls out on Ray workers while the driver trains; set rollout.backend=ray)"),
                ("schedule", self.backend != "local" or self.schedule == "static", "'static' with "
                 "rollout.backend=local", " (it splits a step among Ray workers; set rollout.backend=ray)"),
                ("migration", self.backend != "local" or not self.migration, "false with rollout.backend=local",
                 " (it moves requests between Ray workers; set rollout.backend=ray)"),
                ("tier2", not self.tier2 or self.schedule == "histopipe", "false unless rollout.schedule=histopipe",
                 " (tier 2 splits the groups histopipe predicts long)"),
                ("stream", not self.stream or self.mode == "one_step_off", "false unless rollout.mode=one_step_off",
                 " (the stream queues step t+1 behind step t, one weights version behind)"),
                ("migration_rule", not (self.stream and self.migration) or self.migration_rule in STREAM_MIGRATIONS,
                 f"one of {', '.join(STREAM_MIGRATIONS)} with rollout.stream=true", " (the stream's rules)"),
                ("defer_tail", not (self.defer_tail and self.migration), "false with rollout.migration=true",
                 " (a deferred tail stays on its worker; migration moves it to an idle one: choose one)"),
                ("defer_tail", not self.defer_tail or self.stream, "false unless rollout.stream=true",
                 " (a deferred request continues in its worker's share of the next step, which the stream queues; "
                 "sync mode is refused)"),
                ("max_staleness", self.mode == "sync" or self.max_staleness >= 1, ">= 1 with rollout.mode="
                 "one_step_off", " (it trains on samples of the weights one update older)")]


@dataclass
class TrainSection(_Section):
    """The optimiser and the GRPO loss."""

    # 16 steps and, at 0, prompts per step by the machine (rl/run_settings.DEFAULT_PROMPTS_PER_STEP, resolved at
    # start into the run's config.yaml): the embedded job shows learning within ~10 minutes on a 2-core CPU
    # whether its update runs in bf16 or, without native bf16, in fp32 (docs/notebook)
    total_steps: int = _opt(16, "rollout steps, each one update of num_iterations optimiser steps", check=">= 1")
    prompts_per_step: int = _opt(0, "prompts per rollout batch (x num_generations completions); 0 = by the "
                                 "machine: 4 where the update runs in bf16, 2 in fp32", check=">= 0")
    # 16: fewer, larger matmuls per update than 8, chosen from one-off timings of `PolicyTrainer.update` on
    # the 2-core CPU; no bench command times the update alone, so no figure is claimed for it
    micro_batch_size: int = _opt(16, "sequences per forward/backward on each rank of the update", check=">= 1")
    learning_rate: float = _opt(2e-5, "peak learning rate", check="> 0")
    lr_scheduler: str = _opt("constant", "learning-rate schedule after warmup", LR_SCHEDULERS)
    warmup_steps: int = _opt(0, "linear warmup steps", check=">= 0")
    weight_decay: float = _opt(0.0, "AdamW weight decay", check=">= 0")
    adam_beta1: float = _opt(0.9, "AdamW beta1", check="in [0, 1)")
    adam_beta2: float = _opt(0.99, "AdamW beta2", check="in [0, 1)")
    max_grad_norm: float = _opt(1.0, "gradient clipping norm (0 = off)", check=">= 0 (0 = no clipping)")
    dtype: str = _opt("auto", "bf16 = autocast over fp32 master weights; auto = bf16 where the device has native "
                      "bf16 matmuls, else fp32", DTYPES)
    num_iterations: int = _opt(1, "PPO epochs over each rollout batch (TRL's num_iterations)", check=">= 1")
    recompute_logprobs: bool = _opt(True, "old log-probs from the trainer's own first forward (no extra pass; "
                                    "keeps training independent of speculation) instead of the rollout's")
    # verl's key and TIS; 2.0 as in the TIS write-up (Yao et al. 2025). Only rollout.mode=one_step_off applies
    # it: in sync mode the rollout ran on the trained weights, and weighting by the numerical rollout-vs-trainer
    # gap would make training depend on speculation (see rl/trainer.py).
    tis_imp_ratio_cap: float = _opt(2.0, "rollout.mode=one_step_off: each token's loss times min(exp(old - "
                                    "rollout log-prob), cap), verl's truncated importance sampling (<= 0 = off)")
    loss_type: str = _opt("dapo", "loss normalisation: dapo = over the batch's tokens (TRL's dapo; bnpo is the "
                          "same here, TRL's bnpo is per micro-batch), grpo = per sequence, dr_grpo = B x "
                          "max_completion_length", LOSS_TYPES)
    epsilon: float = _opt(0.2, "lower clip range of the ratio", check="> 0")
    # 0 = epsilon, TRL's default (None there); DAPO's clip-higher sets 0.28. Resolved where the trainer reads it.
    epsilon_high: float = _opt(0.0, "upper clip range of the ratio (>= epsilon; DAPO's clip-higher: 0.28); "
                               "0 = the same as epsilon", check=">= 0")
    beta: float = _opt(0.0, "KL coefficient (reference model loaded only when > 0)", check=">= 0")
    scale_rewards: str = _opt("group", "std used to scale advantages", SCALE_REWARDS)
    filter_groups: bool = _opt(False, "DAPO's dynamic sampling (verl's algorithm.filter_groups): drop groups whose "
                               "rewards are all equal (zero advantage) and roll out more prompts until the step "
                               "has prompts_per_step groups")
    max_num_gen_batches: int = _opt(10, "filter_groups: most rollouts of prompts_per_step prompts per step (verl's "
                                    "max_num_gen_batches); past it the step trains on the groups it has "
                                    "(0 = no limit)", check=">= 0")
    # The update past one process (rl/rank_groups.py); the driver, rollout pool and history stay in the driver.
    world_size: int = _opt(1, "ranks of the update (torch.distributed: gloo on a CPU, NCCL on CUDA); > 1 starts "
                           "them as processes of this machine, as Ray actors with rollout.backend=ray, or takes "
                           "torchrun's processes (then = their number); micro-batches split among them", check=">= 1")
    strategy: str = _opt("fsdp", "world_size > 1: fsdp = FSDP2 fully_shard per decoder layer (weights, gradients "
                         "and AdamW state sharded), ddp = a full replica per rank, gradients all-reduced",
                         ("fsdp", "ddp"))

    def _rules(self) -> list[tuple]:
        return [("epsilon_high", self.epsilon_high == 0 or self.epsilon_high >= self.epsilon,
                 f">= train.epsilon ({self.epsilon!r})")]  # 0 (= epsilon) is documented in the help


@dataclass
class ValSection(_Section):
    """Periodic validation on held-out prompts."""

    every: int = _opt(10, "validate every N steps (0 = never); also at the end", check=">= 0")
    temperature: float = _opt(0.0, "sampling temperature (0 = greedy)", check=">= 0")
    max_completion_length: int = _opt(128, "max new tokens per completion", check=">= 1")


@dataclass
class RunSection(_Section):
    """Output, checkpoints and logging."""

    output_dir: str = _opt("", "run directory; empty = runs/<UTC timestamp>")
    seed: int = _opt(0, "random seed")
    save_every: int = _opt(10, "checkpoint every N steps (0 = only at the end)", check=">= 0")
    keep_checkpoints: int = _opt(2, "most recent checkpoints kept", check=">= 1")
    tensorboard: bool = _opt(True, "write TensorBoard event files")
    wandb: bool = _opt(False, "log to Weights & Biases as well (needs wandb installed)")
    progress: bool = _opt(True, "show a progress bar")


@dataclass
class RaySection(_Section):
    """The Ray cluster of rollout.backend=ray (unused by the local backend)."""

    address: str = _opt("", "'' = start a fresh local cluster for this run (ray.init(address='local'), never a "
                        "stray one that happens to run); auto = join the running cluster (`ray start --head`); "
                        "host:port = join that one. Without Ray's token authentication (RAY_AUTH_MODE=token, Ray "
                        ">= 2.52) whoever reaches a cluster's ports runs code on its nodes: see the README")

    def _rules(self) -> list[tuple]:
        return [("address", self.address in ("", "auto") or re.fullmatch(r"(ray://)?[^\s:/]+:\d+", self.address)
                 is not None, "'', 'auto' or 'host:port'")]


@dataclass
class TrainConfig:
    """The whole config of `rhymerl train`, one dataclass per section."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    reward: RewardSection = field(default_factory=RewardSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    train: TrainSection = field(default_factory=TrainSection)
    val: ValSection = field(default_factory=ValSection)
    run: RunSection = field(default_factory=RunSection)
    ray: RaySection = field(default_factory=RaySection)


# ---------------------------------------------------------------- schema lookups

# The annotations are strings (`from __future__ import annotations`), so they are resolved once here.
_SECTION_NAMES: dict[type, str] = {typing.get_type_hints(TrainConfig)[f.name]: f.name for f in fields(TrainConfig)}
_TYPES: dict[str, dict[str, type]] = {s: typing.get_type_hints(cls) for cls, s in _SECTION_NAMES.items()}
_ALL_KEYS = [f"{s}.{name}" for s, types in _TYPES.items() for name in types]


def validate(cfg: TrainConfig) -> None:
    """Raise ConfigError listing every invalid value (one line each, naming its key); None if valid."""
    errors = [line for f in fields(cfg) for line in getattr(cfg, f.name).validate()]
    if cfg.train.filter_groups and cfg.rollout.mode != "sync":  # the only rule across two sections
        errors.append("train.filter_groups: needs rollout.mode=sync, got rollout.mode=one_step_off (dynamic "
                      "sampling draws further prompts on the weights being trained; set one of the two)")
    if errors:
        raise ConfigError("\n".join(errors))
