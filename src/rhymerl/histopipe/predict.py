"""Response-length prediction from history, and how stable the length ranking is (docs/design.md, section 3, HistoPipe).

"Lengths rhyme": a prompt's responses this epoch are about as long as its responses last epoch, and the
ranking of prompts by length barely moves (the paper: 2-4% of prompts move far). `LengthPredictor` turns
each prompt's group lengths over its last rollouts into one predicted length; the planner ranks and costs
groups with it. `rank_report` is the per-step check of the premise: rank correlation between the predicted
and the actual group lengths, and the share of prompts whose rank moved far.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from rhymerl.history import HistoryStore, prompt_key

Prompt = Sequence[int] | str  # token ids, or their key (`rhymerl.history.prompt_key`)


def quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile of `xs` by linear interpolation between order statistics (numpy's default)."""
    if not xs:
        raise ValueError("quantile of an empty sequence")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarise(lengths: Sequence[float], statistic: str | float) -> float:
    """One length from several: "mean", "max", "median", or a float q in [0, 1] for the q-quantile."""
    if statistic == "mean":
        return sum(lengths) / len(lengths)
    if statistic == "max":
        return float(max(lengths))
    if statistic == "median":
        return quantile(lengths, 0.5)
    return quantile(lengths, float(statistic))


def _check_statistic(statistic: str | float) -> None:
    if isinstance(statistic, str):
        if statistic not in ("mean", "max", "median"):
            raise ValueError(f"statistic must be 'mean', 'max', 'median' or a quantile, got {statistic!r}")
    elif not 0.0 <= float(statistic) <= 1.0:
        raise ValueError(f"a quantile statistic must be in [0, 1], got {statistic}")


def _key(prompt: Prompt) -> str:
    return prompt if isinstance(prompt, str) else prompt_key(prompt)


class LengthPredictor:
    """Per prompt, a predicted response length from the lengths of its group over its last rollouts.

    Args:
        statistic: how a prompt's recorded lengths become one prediction: "mean", "max", "median" or a
            quantile q in [0, 1]. The default 0.75 leans long: a group ends with its longest members, and
            costing a long group as short is what puts it on a worker that is already full.
        max_rollouts: rollouts remembered per prompt (older ones are dropped), like the history store's K.
        prior_quantile: a prompt with no history is predicted at this quantile of every recorded length
            (all prompts, all remembered rollouts, and the siblings seen finishing this step).
        default_length: the prediction before anything at all has been recorded (no data for a prior).

    Online update (`observe_finished`): once some siblings of a prompt's current group have finished, the
    rest are still running, and all siblings start together and decode a token per step, so the unfinished
    ones will be longer than every finished one. A prompt without history is then predicted at the longest
    finished sibling (Seer's estimate); a prompt with history at the larger of that and its history's
    statistic. `record` (the group's final lengths) ends the step for that prompt and clears what was seen.
    """

    def __init__(self, statistic: str | float = 0.75, max_rollouts: int = 4, prior_quantile: float = 0.75,
                 default_length: float = 512.0):
        _check_statistic(statistic)
        if max_rollouts < 1:
            raise ValueError(f"max_rollouts must be >= 1, got {max_rollouts}")
        if not 0.0 <= prior_quantile <= 1.0:
            raise ValueError(f"prior_quantile must be in [0, 1], got {prior_quantile}")
        self.statistic = statistic
        self.max_rollouts = max_rollouts
        self.prior_quantile = prior_quantile
        self.default_length = float(default_length)
        self._history: dict[str, list[list[int]]] = {}  # key -> each remembered rollout's lengths, oldest first
        self._seen: dict[str, list[int]] = {}  # key -> lengths of this step's siblings that have finished
        self._prior: float | None = None  # cached; None when it must be recomputed

    # ---------------------------------------------------------------- feeding

    def record(self, prompt: Prompt, lengths: Sequence[int]) -> None:
        """One finished rollout of a prompt: the lengths (tokens) of its group's responses."""
        if not lengths:
            return
        key = _key(prompt)
        rollouts = self._history.setdefault(key, [])
        rollouts.append([int(n) for n in lengths])
        del rollouts[:-self.max_rollouts]
        self._seen.pop(key, None)  # the group is done: its final lengths supersede what was seen of it
        self._prior = None

    def observe_finished(self, prompt: Prompt, length: int) -> None:
        """A response of the prompt's current group has finished with `length` tokens (see the class doc)."""
        self._seen.setdefault(_key(prompt), []).append(int(length))
        self._prior = None

    def clear_observed(self) -> None:
        """Forget the siblings seen this step (a step that ended without `record` for every prompt)."""
        self._seen.clear()
        self._prior = None

    def load_history(self, store: HistoryStore, prompts: Iterable[Prompt] | None = None) -> None:
        """Replace what is known of `prompts` (default: every stored prompt) by their rollouts in `store`."""
        # Reading every key in the store's LRU order moves each to the end in that same order, so a full
        # load leaves the store's eviction order as it was.
        keys = store.keys() if prompts is None else [_key(p) for p in prompts]
        for key in keys:
            rollouts = [[len(r) for r in ro.responses] for ro in store.rollouts(key)]
            rollouts = [r for r in rollouts if r][-self.max_rollouts:]
            if rollouts:
                self._history[key] = rollouts
            else:
                self._history.pop(key, None)
        self._prior = None

    @classmethod
    def from_history(cls, store: HistoryStore, prompts: Iterable[Prompt] | None = None,
                     **kwargs) -> "LengthPredictor":
        """A predictor knowing the rollouts of `prompts` (default: all) in `store`; kwargs as the class's."""
        predictor = cls(**kwargs)
        predictor.load_history(store, prompts)
        return predictor

    # ---------------------------------------------------------------- predicting

    def __contains__(self, prompt: Prompt) -> bool:
        """Whether the prompt has a history (a prediction of its own rather than the prior)."""
        return _key(prompt) in self._history

    def lengths(self, prompt: Prompt) -> list[list[int]]:
        """The remembered rollouts' lengths of a prompt, oldest first; [] if none."""
        return [list(r) for r in self._history.get(_key(prompt), [])]

    def prior(self) -> float:
        """The prediction for a prompt with no history and no finished sibling (see the class doc)."""
        if self._prior is None:
            pool = [n for rollouts in self._history.values() for r in rollouts for n in r]
            pool += [n for seen in self._seen.values() for n in seen]
            self._prior = quantile(pool, self.prior_quantile) if pool else self.default_length
        return self._prior

    def predict(self, prompt: Prompt) -> float:
        """The predicted response length (tokens) of one request of the prompt's group."""
        key = _key(prompt)
        rollouts = self._history.get(key)
        seen = self._seen.get(key)
        if rollouts is None:
            return float(max(seen)) if seen else self.prior()
        predicted = summarise([n for r in rollouts for n in r], self.statistic)
        return max(predicted, float(max(seen))) if seen else predicted

    def predict_many(self, prompts: Iterable[Prompt]) -> list[float]:
        """`predict` for each prompt, in order."""
        return [self.predict(p) for p in prompts]


# -------------------------------------------------------------------- rank statistics (the per-step report)

def ranks(xs: Sequence[float]) -> list[float]:
    """1-based ranks, ascending; tied values share the mean of their ranks (what Spearman's rho needs)."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(predicted: Sequence[float], actual: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the two rank vectors (ties averaged).
    NaN when it is undefined (fewer than two prompts, or every value of one side equal)."""
    if len(predicted) != len(actual):
        raise ValueError(f"{len(predicted)} predictions but {len(actual)} actual lengths")
    n = len(predicted)
    if n < 2:
        return math.nan
    rp, ra = ranks(predicted), ranks(actual)
    mean = (n + 1) / 2  # the mean rank, ties or not
    cov = sum((p - mean) * (a - mean) for p, a in zip(rp, ra))
    var_p = sum((p - mean) ** 2 for p in rp)
    var_a = sum((a - mean) ** 2 for a in ra)
    if var_p == 0 or var_a == 0:
        return math.nan
    return cov / math.sqrt(var_p * var_a)


def moved_far_share(predicted: Sequence[float], actual: Sequence[float], far: float = 0.25) -> float:
    """The share of prompts whose rank by actual length differs from their rank by predicted length by more
    than `far` x the number of prompts (the paper's "moved far"; 0.25 = more than a quarter of the ranks)."""
    if len(predicted) != len(actual):
        raise ValueError(f"{len(predicted)} predictions but {len(actual)} actual lengths")
    n = len(predicted)
    if n == 0:
        return 0.0
    moved = sum(abs(p - a) > far * n for p, a in zip(ranks(predicted), ranks(actual)))
    return moved / n


def rank_report(predicted: Sequence[float], actual: Sequence[float], far: float = 0.25) -> dict[str, float]:
    """The per-step report of the length ranking: {"rank_corr", "moved_far", "prompts"}; one value per
    prompt on each side (e.g. its predicted length and its group's actual mean length)."""
    return {"rank_corr": spearman(predicted, actual), "moved_far": moved_far_share(predicted, actual, far),
            "prompts": len(predicted)}
