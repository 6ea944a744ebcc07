"""The typed config of `rhymerl train`: dataclass sections, YAML + `key=value` overrides, validation.

A config is built in three layers, later ones winning:

1. the dataclass defaults below (they run the embedded arithmetic job on smollm2-135m);
2. an optional YAML file, a mapping of sections (``rollout: {temperature: 0.6}``);
3. command-line overrides ``section.field=value``, applied in order.

Every value is checked against its field's annotated type, then `validate` checks ranges and
choices. All failures raise `ConfigError` with a message that names the key (and the file).

No torch here: the CLI must be able to print `--help` and reject a bad config instantly.
"""

from __future__ import annotations

import difflib
import math
import typing
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import yaml

from rhymerl.data.dataset import BUILTIN_TASKS  # torch-free, like this module

__all__ = [
    "BUILTIN_TASKS", "DRAFT_RULES", "DTYPES", "LOSS_TYPES", "LR_SCHEDULERS", "SCALE_REWARDS", "SPECULATIVE_MODES",
    "ConfigError", "DataSection", "ModelSection", "RewardSection", "RolloutSection", "RunSection", "TrainConfig",
    "TrainSection", "ValSection", "config_from_dict", "config_help", "config_to_dict", "load_config", "save_config",
    "validate",
]

# Allowed values of the enum-like string fields (validate checks them). This module stays torch-free (so
# `rhymerl train --help` is instant), hence copies of the torch modules' lists; tests/test_trainer.py checks
# that each copy equals what the implementing module accepts.
SPECULATIVE_MODES = ("histospec", "off")
DTYPES = ("auto", "bf16", "fp32")
DRAFT_RULES = ("aimd", "doubling", "cost")
LR_SCHEDULERS = ("constant", "linear", "cosine")
LOSS_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")


class ConfigError(ValueError):
    """A config file, override or value is invalid; the message names the offending key."""


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field with its help text (and allowed values) kept in the field metadata."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


# ---------------------------------------------------------------- sections


@dataclass
class ModelSection:
    """The policy model and how it is fine-tuned."""

    name: str = _opt("smollm2-135m", "built-in name, HF model dir, .gguf file or hub id")
    lora_r: int = _opt(0, "0 = full fine-tuning; >0 = LoRA rank (via peft)")
    lora_alpha: int = _opt(32, "LoRA alpha (scale = alpha / r)")
    lora_dropout: float = _opt(0.0, "LoRA dropout, in [0, 1)")


@dataclass
class DataSection:
    """Training and validation prompts."""

    task: str = _opt("arithmetic", "built-in task, used when train_files is empty", BUILTIN_TASKS)
    train_files: str = _opt("", "JSONL or Parquet path (GSM8K or verl layout); empty = the built-in task")
    val_files: str = _opt("", "same layout; empty = held-out prompts of the built-in task, or none")
    num_train_prompts: int = _opt(32, "size of the fixed built-in prompt set (prompts recur every epoch)")
    num_val_prompts: int = _opt(16, "number of built-in held-out prompts (0 = none)")
    max_prompt_length: int = _opt(256, "tokens; longer prompts are skipped and counted")
    skip_malformed: bool = _opt(False, "skip and count malformed dataset rows instead of failing")
    shuffle: bool = _opt(True, "shuffle the prompts every epoch")


@dataclass
class RewardSection:
    """How completions are scored."""

    format_weight: float = _opt(0.2, "weight of the format reward added to correctness")
    function: str = _opt("", "user reward 'module:function' or 'path/to/file.py:function'; "
                              "replaces the built-in scorer")


@dataclass
class RolloutSection:
    """Generation of the completions (the rollout engine)."""

    num_generations: int = _opt(8, "completions per prompt (the GRPO group size, >= 2)")
    max_completion_length: int = _opt(128, "max new tokens per completion")
    temperature: float = _opt(1.0, "sampling temperature (0 = greedy)")
    top_p: float = _opt(1.0, "nucleus sampling, in (0, 1]")
    top_k: int = _opt(0, "top-k sampling (0 = off)")
    speculative: str = _opt("histospec", "speculative decoding from past rollouts", SPECULATIVE_MODES)
    num_slots: int = _opt(32, "sequences decoded concurrently by the engine")
    dtype: str = _opt("auto", "rollout engine weights; auto = bf16 where the device has native bf16 matmuls "
                      "(CUDA, CPUs with AVX-512 or AMX), else fp32", DTYPES)
    history_rollouts: int = _opt(4, "rollouts kept per prompt by the history store (drafting source)")
    max_draft_tokens: int = _opt(32, "longest draft proposed per step")
    draft_rule: str = _opt("cost", "per-sequence draft length: cost = full trees, the step budget alone decides; "
                           "aimd = the paper's +2 / back to 2; doubling = x2 / halve", DRAFT_RULES)


@dataclass
class TrainSection:
    """The optimiser and the GRPO loss."""

    total_steps: int = _opt(40, "optimiser steps (each on one rollout batch)")
    prompts_per_step: int = _opt(4, "prompts per rollout batch (x num_generations completions)")
    # 16: fewer, larger matmuls per update than 8, chosen from one-off timings of `PolicyTrainer.update` on
    # the 2-core CPU; no bench command times the update alone, so no figure is claimed for it
    micro_batch_size: int = _opt(16, "sequences per forward/backward")
    learning_rate: float = _opt(2e-5, "peak learning rate")
    lr_scheduler: str = _opt("constant", "learning-rate schedule after warmup", LR_SCHEDULERS)
    warmup_steps: int = _opt(0, "linear warmup steps")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    adam_beta1: float = _opt(0.9, "AdamW beta1")
    adam_beta2: float = _opt(0.99, "AdamW beta2")
    max_grad_norm: float = _opt(1.0, "gradient clipping norm (0 = off)")
    dtype: str = _opt("auto", "bf16 = autocast over fp32 master weights; auto = bf16 where the device has native "
                      "bf16 matmuls, else fp32", DTYPES)
    num_iterations: int = _opt(1, "PPO epochs over each rollout batch (TRL's num_iterations)")
    recompute_logprobs: bool = _opt(True, "old log-probs from the trainer's own first forward (no extra pass; "
                                    "keeps training independent of speculation) instead of the rollout's")
    loss_type: str = _opt("dapo", "loss normalisation", LOSS_TYPES)
    epsilon: float = _opt(0.2, "lower clip range of the ratio")
    epsilon_high: float = _opt(0.28, "upper clip range of the ratio (>= epsilon; clip-higher)")
    beta: float = _opt(0.0, "KL coefficient (reference model loaded only when > 0)")
    scale_rewards: str = _opt("group", "std used to scale advantages", SCALE_REWARDS)


@dataclass
class ValSection:
    """Periodic validation on held-out prompts."""

    every: int = _opt(10, "validate every N steps (0 = never); also at the end")
    temperature: float = _opt(0.0, "sampling temperature (0 = greedy)")
    max_completion_length: int = _opt(128, "max new tokens per completion")


@dataclass
class RunSection:
    """Output, checkpoints and logging."""

    output_dir: str = _opt("", "run directory; empty = runs/<UTC timestamp>")
    seed: int = _opt(0, "random seed")
    save_every: int = _opt(10, "checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = _opt(2, "most recent checkpoints kept")
    tensorboard: bool = _opt(True, "write TensorBoard event files")
    wandb: bool = _opt(False, "log to Weights & Biases as well (needs wandb installed)")
    progress: bool = _opt(True, "show a progress bar")


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


# ---------------------------------------------------------------- schema

# section -> (section class, {field name -> (resolved type, dataclass Field)}). The annotations are
# strings (`from __future__ import annotations`), so they are resolved once here.
_SCHEMA: dict[str, tuple[type, dict[str, tuple[type, Field]]]] = {}
for _sec in fields(TrainConfig):
    _cls = typing.get_type_hints(TrainConfig)[_sec.name]
    _hints = typing.get_type_hints(_cls)
    _SCHEMA[_sec.name] = (_cls, {f.name: (_hints[f.name], f) for f in fields(_cls)})
_ALL_KEYS = [f"{s}.{name}" for s, (_, fs) in _SCHEMA.items() for name in fs]


def _suggest(name: str, candidates: Sequence[str]) -> str:
    """' (did you mean ...?)' for the closest candidates, or ''."""
    # A bare field name ('temperature') is most likely meant as one of the keys ending in it.
    exact = [c for c in candidates if c.endswith("." + name)]
    close = exact or difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _lookup(key: str, where: str) -> tuple[str, str, type]:
    """Split 'section.field' into its parts and type; `where` prefixes errors (a file name or '')."""
    section, _, name = key.partition(".")
    if section not in _SCHEMA or name not in _SCHEMA[section][1]:
        raise ConfigError(f"{where}unknown key {key!r}{_suggest(key, _ALL_KEYS)}")
    return section, name, _SCHEMA[section][1][name][0]


def _coerce(key: str, value: Any, typ: type) -> Any:
    """`value` checked against (and converted to) the field type `typ`; ConfigError names `key`."""
    ok = False
    if typ is bool:
        ok = isinstance(value, bool)
    elif typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif typ is float:
        if isinstance(value, str):
            # YAML 1.1 reads '1e-5' (no dot) as a string: accept any number Python can parse.
            try:
                value = float(value.strip())
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value, ok = float(value), True
            if not math.isfinite(value):
                raise ConfigError(f"{key}: must be a finite number, got {value!r}")
    elif typ is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # `name: 123` in a YAML file means the string "123"
        ok = isinstance(value, str)
    else:  # pragma: no cover - guards against a new field type nobody taught _coerce
        raise TypeError(f"{key}: unsupported config field type {typ!r}")
    if not ok:
        hint = " (true/false)" if typ is bool else ""
        raise ConfigError(f"{key}: expected {typ.__name__}{hint}, got {value!r}")
    return value


def _parse_override(text: str) -> tuple[str, str, Any]:
    """`section.field=value` -> (section, field, typed value)."""
    key, sep, raw = text.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not key=value (e.g. rollout.temperature=0.6)")
    section, name, typ = _lookup(key, "")
    if typ is str:
        # A str field takes the text as typed ('model.name=123' is "123"); quotes are only stripped.
        value: Any = raw
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError:
                value = raw
    else:
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError:
            value = raw  # _coerce rejects it with the key in the message
    return section, name, _coerce(key, value, typ)


def _merge_mapping(values: dict[str, dict[str, Any]], data: Any, source: str) -> None:
    """Merge a nested {section: {field: value}} mapping into `values`, checking names and types."""
    where = f"{source}: " if source else ""
    if data is None:  # an empty YAML file
        return
    if not isinstance(data, dict):
        raise ConfigError(f"{where}top level must be a mapping of sections ({', '.join(_SCHEMA)}), "
                          f"got {type(data).__name__}")
    for section, body in data.items():
        if section not in _SCHEMA:
            if isinstance(section, str) and section in _ALL_KEYS:
                s, _, f = section.partition(".")
                raise ConfigError(f"{where}keys are nested by section: write '{s}: {{{f}: ...}}', not {section!r}")
            raise ConfigError(f"{where}unknown section {section!r}{_suggest(str(section), list(_SCHEMA))}; "
                              f"sections are {', '.join(_SCHEMA)}")
        if body is None:  # `rollout:` with nothing under it
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{where}section {section!r} must be a mapping, got {type(body).__name__}")
        for name, value in body.items():
            key = f"{section}.{name}"
            _, _, typ = _lookup(key, where)
            try:
                values[section][name] = _coerce(key, value, typ)
            except ConfigError as e:
                raise ConfigError(f"{where}{e}") from None


def _build(values: dict[str, dict[str, Any]]) -> TrainConfig:
    return TrainConfig(**{s: _SCHEMA[s][0](**values[s]) for s in _SCHEMA})


# ---------------------------------------------------------------- public API


def config_to_dict(cfg: TrainConfig) -> dict[str, dict[str, Any]]:
    """The config as a nested plain dict, sections and fields in declaration order."""
    return {s: {name: getattr(getattr(cfg, s), name) for name in fs} for s, (_, fs) in _SCHEMA.items()}


def config_from_dict(d: dict[str, Any], source: str = "") -> TrainConfig:
    """A validated config from a nested dict (as written by `config_to_dict`); missing keys take defaults.

    `source` (e.g. a file name) prefixes error messages.
    """
    values = config_to_dict(TrainConfig())
    _merge_mapping(values, d, source)
    cfg = _build(values)
    validate(cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Defaults <- YAML file at `path` (if given) <- `section.field=value` overrides in order; validated."""
    if isinstance(overrides, str):  # a lone string would be iterated character by character
        raise TypeError("load_config: overrides must be a sequence of 'key=value' strings, not a str")
    values = config_to_dict(TrainConfig())
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config file ({e.strerror or e})") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        _merge_mapping(values, data, str(path))
    for text in overrides:
        section, name, value = _parse_override(text)
        values[section][name] = value
    cfg = _build(values)
    validate(cfg)
    return cfg


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """Write `cfg` as YAML (sections in order) so that `load_config(path)` gives it back."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False))


def validate(cfg: TrainConfig) -> None:
    """Raise ConfigError listing every invalid value (one line each, naming its key); None if valid."""
    # Types first: range checks on a value of the wrong type would raise TypeError instead.
    errors = []
    for key in _ALL_KEYS:
        section, name = key.split(".")
        try:
            _coerce(key, getattr(getattr(cfg, section), name), _SCHEMA[section][1][name][0])
        except ConfigError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError("\n".join(errors))

    def need(ok: bool, key: str, rule: str, note: str = "") -> None:
        if not ok:
            section, name = key.split(".")
            errors.append(f"{key}: must be {rule}, got {getattr(getattr(cfg, section), name)!r}{note}")

    for key in _ALL_KEYS:
        section, name = key.split(".")
        choices = _SCHEMA[section][1][name][1].metadata.get("choices")
        if choices is not None:
            need(getattr(getattr(cfg, section), name) in choices, key, f"one of {', '.join(map(repr, choices))}")

    m, d, r, ro, t, v, run = cfg.model, cfg.data, cfg.reward, cfg.rollout, cfg.train, cfg.val, cfg.run
    need(m.name.strip() != "", "model.name", "non-empty")
    need(m.lora_r >= 0, "model.lora_r", ">= 0")
    need(m.lora_alpha > 0, "model.lora_alpha", "> 0")
    need(0 <= m.lora_dropout < 1, "model.lora_dropout", "in [0, 1)")

    need(d.num_train_prompts >= 1, "data.num_train_prompts", ">= 1")
    need(d.num_val_prompts >= 0, "data.num_val_prompts", ">= 0")
    need(d.max_prompt_length >= 1, "data.max_prompt_length", ">= 1")

    need(r.format_weight >= 0, "reward.format_weight", ">= 0")
    if r.function:
        module, _, func = r.function.rpartition(":")
        need(bool(module) and func.isidentifier(), "reward.function",
             "'module:function' or 'path/to/file.py:function'")

    need(ro.num_generations >= 2, "rollout.num_generations", ">= 2",
         " (GRPO compares completions of one prompt: a group of 1 has zero advantage)")
    need(ro.max_completion_length >= 1, "rollout.max_completion_length", ">= 1")
    need(ro.temperature >= 0, "rollout.temperature", ">= 0")
    need(0 < ro.top_p <= 1, "rollout.top_p", "in (0, 1]")
    need(ro.top_k >= 0, "rollout.top_k", ">= 0")
    need(ro.num_slots >= 1, "rollout.num_slots", ">= 1")
    need(ro.history_rollouts >= 1, "rollout.history_rollouts", ">= 1")
    need(ro.max_draft_tokens >= 1, "rollout.max_draft_tokens", ">= 1")

    need(t.total_steps >= 1, "train.total_steps", ">= 1")
    need(t.prompts_per_step >= 1, "train.prompts_per_step", ">= 1")
    need(t.micro_batch_size >= 1, "train.micro_batch_size", ">= 1")
    need(t.learning_rate > 0, "train.learning_rate", "> 0")
    need(t.warmup_steps >= 0, "train.warmup_steps", ">= 0")
    need(t.weight_decay >= 0, "train.weight_decay", ">= 0")
    need(0 <= t.adam_beta1 < 1, "train.adam_beta1", "in [0, 1)")
    need(0 <= t.adam_beta2 < 1, "train.adam_beta2", "in [0, 1)")
    need(t.max_grad_norm >= 0, "train.max_grad_norm", ">= 0 (0 = no clipping)")
    need(t.num_iterations >= 1, "train.num_iterations", ">= 1")
    need(t.epsilon > 0, "train.epsilon", "> 0")
    need(t.epsilon_high >= t.epsilon, "train.epsilon_high", f">= train.epsilon ({t.epsilon!r})")
    need(t.beta >= 0, "train.beta", ">= 0")

    need(v.every >= 0, "val.every", ">= 0")
    need(v.temperature >= 0, "val.temperature", ">= 0")
    need(v.max_completion_length >= 1, "val.max_completion_length", ">= 1")

    need(run.save_every >= 0, "run.save_every", ">= 0")
    need(run.keep_checkpoints >= 1, "run.keep_checkpoints", ">= 1")
    if errors:
        raise ConfigError("\n".join(errors))


def _show(value: Any) -> str:
    """A default as it would be typed in an override (YAML spelling for bools, quotes for '')."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return "''"
    return str(value)


def config_help() -> str:
    """Every key as `section.field  type = default  help`, grouped by section (for `rhymerl train --help`)."""
    rows = []
    for section, (cls, fs) in _SCHEMA.items():
        for name, (typ, f) in fs.items():
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            text = f.metadata.get("help", "")
            if "choices" in f.metadata:
                text += f" [{' | '.join(f.metadata['choices'])}]"
            rows.append((section, f"{section}.{name}", f"{typ.__name__} = {_show(default)}", text))
    w_key = max(len(r[1]) for r in rows)
    w_type = max(len(r[2]) for r in rows)
    lines: list[str] = []
    for section, (cls, _) in _SCHEMA.items():
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        lines.append(f"{section}:  {doc}".rstrip())
        for sec, key, typ_default, text in rows:
            if sec == section:
                lines.append(f"  {key:<{w_key}}  {typ_default:<{w_type}}  {text}".rstrip())
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
