"""Whether a length trace rhymes: the figures that say if a prompt's past lengths predict its next ones.

`rhyme_stats(rows, cap)` reads a trace's steps (`trace.read_trace`) by epoch, where a prompt's k-th
appearance is its epoch k (so that a shuffled or uneven order of prompts within the run does not matter),
and gives:

- `spearman`: per pair of consecutive epochs, the rank correlation of the prompts' mean lengths (prompts
  seen in both), and their mean. Near 1: last epoch's ranking is this epoch's, what HistoPipe schedules by.
- `at_cap`: the share of responses of `cap` tokens or more (cut off at max_completion_length): a length cut
  at the cap says only "at least", and a trace where most are cut gives a ranking of ties.
- `between_prompt_share`: the share of the lengths' variance between prompts' means (the rest is within a
  prompt's responses): how much of a response's length its prompt tells.
- `spread`: the lengths' min, p10, median, p90 and max, and p90 / p10.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import fmean

from rhymerl.histopipe.predict import quantile, spearman


def epochs_by_appearance(rows: list[dict]) -> list[dict[str, list[int]]]:
    """The trace's lengths per epoch: epoch k maps each prompt to the lengths of its k-th appearance."""
    seen: dict[str, int] = defaultdict(int)
    epochs: list[dict[str, list[int]]] = []
    for row in rows:
        for group in row["groups"]:
            k = seen[group["prompt"]]
            seen[group["prompt"]] += 1
            while len(epochs) <= k:
                epochs.append({})
            epochs[k].setdefault(group["prompt"], []).extend(group["lengths"])
    return epochs


def rhyme_stats(rows: list[dict], cap: int) -> dict:
    """The trace's rank statistics (see the module doc); `cap`: the run's max_completion_length."""
    epochs = epochs_by_appearance(rows)
    lengths = [x for row in rows for g in row["groups"] for x in g["lengths"]]
    if not lengths:
        raise ValueError("the trace has no lengths")
    pairs = []
    for before, after in zip(epochs, epochs[1:]):
        common = sorted(set(before) & set(after))
        if len(common) >= 2:
            pairs.append(spearman([fmean(before[p]) for p in common], [fmean(after[p]) for p in common]))
    mean = fmean(lengths)
    by_prompt = defaultdict(list)
    for row in rows:
        for g in row["groups"]:
            by_prompt[g["prompt"]].extend(g["lengths"])
    total = sum((x - mean) ** 2 for x in lengths)
    between = sum(len(xs) * (fmean(xs) - mean) ** 2 for xs in by_prompt.values())
    p10, p90 = quantile(lengths, 0.1), quantile(lengths, 0.9)
    return {
        "steps": len(rows), "prompts": len(by_prompt), "responses": len(lengths),
        "appearances_min": min(sum(p in e for e in epochs) for p in by_prompt),
        "spearman": pairs, "spearman_mean": fmean(pairs) if pairs else float("nan"),
        "at_cap": sum(x >= cap for x in lengths) / len(lengths),
        "between_prompt_share": between / total if total else 0.0,
        "spread": {"min": min(lengths), "p10": p10, "median": quantile(lengths, 0.5), "p90": p90,
                   "max": max(lengths), "p90_over_p10": p90 / p10 if p10 else float("inf")},
    }
