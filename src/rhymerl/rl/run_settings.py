"""The settings a training run derives from its config and its machine, before it builds anything: the
dtypes it computes in (`run_dtypes`), the config with its machine-dependent defaults resolved
(`resolve_machine_defaults`, what the run saves as its config.yaml) and its rollout workers' config
(`worker_config`)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from rhymerl.config import TrainConfig
from rhymerl.model.capacity import check_context
from rhymerl.model.pretrained import parse_dtype, resolve_dtype
from rhymerl.rollout import WorkerConfig


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


# train.prompts_per_step left at 0, by what the update computes in, so that `bash scripts/run.sh` (16 steps) shows
# the format reward rising within ~10 minutes on a 2-core CPU (docs/notebook). At 4 prompts x 8 a bf16
# step took 15-21 s on Sapphire Rapids (the update ~1.5x longer with AMX masked off, as on Zen 4), an fp32 one
# 51-69 s on an AVX2-only Zen 3 (docs/notebook, d740e7d), 32 s of it the update, which halves with the
# batch.
DEFAULT_PROMPTS_PER_STEP = {"bf16": 4, "fp32": 2}

# rollout.max_draft_tokens left at 0, by what the rollout computes in. In fp32 on a CPU a verification row costs
# nearly what a decode row does, and drafts capped at 4 tokens measured ahead of the budget's uncapped trees:
# bench spec --dtype fp32, T=0.3, 1.17x against 1.09x plain on held-out prompts and on countdown (docs/notebook,
# bdd48d4 and 2ebf784); in bf16 with AMX the deep tails gain 2.3x-2.6x.
DEFAULT_MAX_DRAFT_TOKENS = {"bf16": 32, "fp32": 4}


def resolve_machine_defaults(cfg: TrainConfig, dtypes: dict[str, str]) -> TrainConfig:
    """`cfg` with what depends on the machine made explicit, once at the start of a run: `rollout.dtype` and
    `train.dtype` as `run_dtypes` resolved them, `train.prompts_per_step` left at 0 by the update's dtype
    (DEFAULT_PROMPTS_PER_STEP) and `rollout.max_draft_tokens` left at 0 by the rollout's
    (DEFAULT_MAX_DRAFT_TOKENS). The run uses and saves this config, so its config.yaml says what ran and a
    resume on another kind of machine repeats it."""
    prompts = cfg.train.prompts_per_step or DEFAULT_PROMPTS_PER_STEP[dtypes["train"]]
    draft = cfg.rollout.max_draft_tokens or DEFAULT_MAX_DRAFT_TOKENS[dtypes["rollout"]]
    train = replace(cfg.train, dtype=dtypes["train"], prompts_per_step=prompts)
    return replace(cfg, rollout=replace(cfg.rollout, dtype=dtypes["rollout"], max_draft_tokens=draft), train=train)


def worker_config(cfg: TrainConfig, model_dir: Path, device: str) -> WorkerConfig:
    """Each rollout worker's config: the rollout section of `cfg` (its machine defaults resolved:
    `resolve_machine_defaults`) and a context long enough for a prompt plus the longer of the rollout's and
    validation's completions; `check_context` first, so a context the device cannot hold is named by the keys
    that set it rather than met as an out-of-memory error mid-run."""
    max_len = cfg.data.max_prompt_length + max(cfg.rollout.max_completion_length, cfg.val.max_completion_length) + 1
    check_context(model_dir, max_model_len=max_len - 1, num_slots=cfg.rollout.num_slots,
                  dtype=parse_dtype(cfg.rollout.dtype, device), device=device, slots_key="rollout.num_slots",
                  key=f"data.max_prompt_length ({cfg.data.max_prompt_length}) + the longest "
                      f"rollout/val.max_completion_length ({max_len - 1 - cfg.data.max_prompt_length})")
    return WorkerConfig(cfg.rollout, max_model_len=max_len)
