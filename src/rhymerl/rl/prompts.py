"""The prompt stream of a run: the train and val prompts, loaded and chat-encoded once, and which rows
step t reads (`batch_indices`, a pure function of the step and the seed, so a resumed run reads what the
uninterrupted one would have). Apart from `rl.loop`, which owns the steps and only asks for rows.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass

from rhymerl.config import ConfigError, TrainConfig
from rhymerl.data.dataset import Example, builtin_examples, read_dataset
from rhymerl.model.pretrained import chat_prompt_ids


@dataclass
class Prompt:
    example: Example
    ids: list[int]


def batch_indices(step: int, num_prompts: int, per_step: int, seed: int, shuffle: bool) -> list[int]:
    """Dataset rows of step `step` (0-based): a stream of epochs, each a permutation keyed by (seed, epoch),
    read `per_step` rows at a time. A pure function of its arguments: the data position is the step."""
    out = []
    for pos in range(step * per_step, (step + 1) * per_step):
        epoch, i = divmod(pos, num_prompts)
        order = list(range(num_prompts))
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.append(order[i])
    return out


def encode_prompts(tokenizer, examples: list[Example], max_len: int, what: str) -> tuple[list[Prompt], list[str]]:
    """Chat-template token ids of each example; a prompt longer than `max_len` tokens is skipped and reported."""
    kept, skipped = [], []
    for ex in examples:
        ids = chat_prompt_ids(tokenizer, ex.messages())
        if len(ids) > max_len:
            skipped.append(f"{ex.source}: {what} prompt has {len(ids)} tokens > data.max_prompt_length={max_len}")
        else:
            kept.append(Prompt(ex, ids))
    return kept, skipped


def load_prompts(cfg: TrainConfig, tokenizer, seed: int) -> tuple[list[Prompt], list[Prompt], dict]:
    """Train and val prompts of a run (its data files, else `data.task`'s built-in examples keyed by `seed`),
    encoded, and notes for the first metrics row (rows skipped as malformed or too long)."""
    d, notes = cfg.data, {}
    if d.train_files:
        loaded = read_dataset(d.train_files, skip_malformed=d.skip_malformed)
        train, notes["data/skipped_rows"] = loaded.examples, len(loaded.skipped)
        for msg in loaded.skipped[:5]:
            print(f"[data] skipped {msg}", file=sys.stderr)
        val = read_dataset(d.val_files, skip_malformed=d.skip_malformed).examples if d.val_files else []
    else:
        train = builtin_examples(d.task, d.num_train_prompts, seed)
        seen = {ex.prompt for ex in train}  # held out: no validation prompt is also a training prompt
        val = [ex for ex in builtin_examples(d.task, d.num_val_prompts * 2, seed + 7919)
               if ex.prompt not in seen][: d.num_val_prompts]
    train_p, skipped = encode_prompts(tokenizer, train, d.max_prompt_length, "train")
    val_p, skipped_val = encode_prompts(tokenizer, val, d.max_prompt_length, "val")
    for msg in (skipped + skipped_val)[:5]:
        print(f"[data] skipped {msg}", file=sys.stderr)
    notes["data/skipped_long_prompts"] = len(skipped) + len(skipped_val)
    if not train_p:
        raise ConfigError(f"no training prompts left (all {len(train)} longer than data.max_prompt_length="
                          f"{d.max_prompt_length} tokens?): raise data.max_prompt_length")
    return train_p, val_p, notes
