"""Response-length prediction from history, and how stable the length ranking is (docs/design.md, section 3, HistoPipe).

"Lengths rhyme": a prompt's responses this epoch are about as long as its responses last epoch, and the
ranking of prompts by length barely moves (the paper: 2-4% of prompts move far). `LengthPredictor` turns
each prompt's group lengths over its last rollouts into one predicted length; the planner ranks and costs
groups with it, and the training step's `histopipe/rank_corr` reports the same predictor (one predictor,
not one per caller). `rank_report` is the per-step check of the premise: rank correlation between the
predicted and the actual group lengths, and the share of prompts whose rank moved far.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from statistics import NormalDist

from rhymerl.histopipe.censored import (Stats, expected_length, fit_stats, log_stats, merged, pooled_stats,
                                        quantile_length)
from rhymerl.history import HistoryStore, prompt_key

Prompt = Sequence[int] | str  # token ids, or their key (`rhymerl.history.prompt_key`)
SHIFT_Z = 3.0  # a last rollout this many standard errors from the older ones: the prompt has shifted
SHIFTED_P = 0.1  # a running request this unlikely under its prompt's distribution: predicted from the prior


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
    """One length from several: "mean", "max", "median", or a float q in [0, 1] for the q-quantile;
    "lognormal" (the censored predictor's point prediction estimates a request's mean length) is the mean."""
    if statistic in ("mean", "lognormal"):
        return sum(lengths) / len(lengths)
    if statistic == "max":
        return float(max(lengths))
    if statistic == "median":
        return quantile(lengths, 0.5)
    return quantile(lengths, float(statistic))


def _check_statistic(statistic: str | float) -> None:
    if isinstance(statistic, str):
        if statistic not in ("lognormal", "mean", "max", "median"):
            raise ValueError(f"statistic must be 'lognormal', 'mean', 'max', 'median' or a quantile, "
                             f"got {statistic!r}")
    elif not 0.0 <= float(statistic) <= 1.0:
        raise ValueError(f"a quantile statistic must be in [0, 1], got {statistic}")


def _key(prompt: Prompt) -> str:
    return prompt if isinstance(prompt, str) else prompt_key(prompt)


class LengthPredictor:
    """Per prompt, a predicted response length from the lengths of its group over its last rollouts.

    Args:
        statistic: how a prompt's recorded lengths become one prediction. "lognormal" (the default): a
            lognormal fitted to them with the lengths at `cap` censored (lower bounds; `censored`), the
            prediction a request's expected length once cut at the cap. Or, without censoring, "mean",
            "max", "median" or a quantile q in [0, 1] of the recorded lengths. A prompt whose last rollout
            moved far from its older ones (a rank shift) is fitted to its last rollout alone.
        max_rollouts: rollouts remembered per prompt (older ones are dropped), like the history store's K.
        prior_quantile: the quantile statistics' prior: a prompt with no history is predicted at this
            quantile of every recorded length (all prompts, all remembered rollouts, and the siblings seen
            finishing this step).
        default_length: the prediction before anything at all has been recorded (no data for a prior).
        cap: `max_completion_length`: a recorded length at or past it was cut there (censored). None: no
            length is known to be cut.

    Fallback for a prompt without history (lognormal): the data set's prior, the lognormal of every
    prompt's fitted level (their mean, their spread added to the within-prompt spread).

    Online update (`observe_finished`): once some siblings of a prompt's current group have finished, the
    rest are still running, and all siblings start together and decode a token per step, so the unfinished
    ones will be longer than every finished one. The prediction is then conditioned on that: the expected
    length past the longest finished sibling under the prompt's (or the prior's) lognormal; with a quantile
    statistic, the larger of the history's statistic and the longest finished sibling (Seer's estimate).
    `record` (the group's final lengths) ends the step for that prompt and clears what was seen.
    """

    def __init__(self, statistic: str | float = "lognormal", max_rollouts: int = 4, prior_quantile: float = 0.75,
                 default_length: float = 512.0, cap: int | None = None):
        _check_statistic(statistic)
        if max_rollouts < 1:
            raise ValueError(f"max_rollouts must be >= 1, got {max_rollouts}")
        if not 0.0 <= prior_quantile <= 1.0:
            raise ValueError(f"prior_quantile must be in [0, 1], got {prior_quantile}")
        if cap is not None and cap < 1:
            raise ValueError(f"cap must be >= 1 (max_completion_length) or None, got {cap}")
        self.statistic = statistic
        self.max_rollouts = max_rollouts
        self.prior_quantile = prior_quantile
        self.default_length = float(default_length)
        self.cap = cap
        self._history: dict[str, list[list[int]]] = {}  # key -> each remembered rollout's lengths, oldest first
        self._stats: dict[str, list[Stats]] = {}  # key -> each remembered rollout's `censored.log_stats`
        self._seen: dict[str, list[int]] = {}  # key -> lengths of this step's siblings that have finished
        self._prior: float | None = None  # cached; None when it must be recomputed
        self._fit: tuple[float, dict[str, float], tuple[float, float] | None] | None = None  # lognormal, cached

    # ---------------------------------------------------------------- feeding

    def record(self, prompt: Prompt, lengths: Sequence[int]) -> None:
        """One finished rollout of a prompt: the lengths (tokens) of its group's responses."""
        if not lengths:
            return
        key = _key(prompt)
        rollouts = self._history.setdefault(key, [])
        rollouts.append([int(n) for n in lengths])
        del rollouts[:-self.max_rollouts]
        self._stats.pop(key, None)
        self._seen.pop(key, None)  # the group is done: its final lengths supersede what was seen of it
        self._prior, self._fit = None, None

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
            self._stats.pop(key, None)
        self._prior, self._fit = None, None

    def copy(self) -> "LengthPredictor":
        """An independent predictor knowing the same rollouts (nothing observed this step)."""
        other = LengthPredictor(self.statistic, self.max_rollouts, self.prior_quantile, self.default_length, self.cap)
        other._history = {k: [list(r) for r in rollouts] for k, rollouts in self._history.items()}
        return other

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
        if self.statistic == "lognormal":
            _, _, prior = self._lognormal()
            return self.default_length if prior is None else expected_length(*prior, self.cap)
        if self._prior is None:
            pool = [n for rollouts in self._history.values() for r in rollouts for n in r]
            pool += [n for seen in self._seen.values() for n in seen]
            self._prior = quantile(pool, self.prior_quantile) if pool else self.default_length
        return self._prior

    def predict(self, prompt: Prompt) -> float:
        """The predicted response length (tokens) of one request of the prompt's group."""
        key = _key(prompt)
        seen = self._seen.get(key)
        if self.statistic == "lognormal":
            dist = self._distribution(key)
            if dist is None:  # nothing recorded anywhere
                return max(self.default_length, float(max(seen))) if seen else self.default_length
            return expected_length(*dist, self.cap, above=float(max(seen)) if seen else 0.0)
        rollouts = self._history.get(key)
        if rollouts is None:
            return float(max(seen)) if seen else self.prior()
        predicted = summarise([n for r in rollouts for n in r], self.statistic)
        return max(predicted, float(max(seen))) if seen else predicted

    def predict_group(self, prompt: Prompt, size: int) -> list[float]:
        """Predicted lengths of the `size` requests of the prompt's group, longest first: with "lognormal",
        the fitted distribution's quantiles (i + 1/2) / size (a group ends with its longest member, which its
        mean hides); with another statistic, `predict` for each."""
        key = _key(prompt)
        dist = self._distribution(key) if self.statistic == "lognormal" else None
        if dist is None:
            return [self.predict(key)] * size
        seen = self._seen.get(key)
        above = float(max(seen)) if seen else 0.0
        return [quantile_length(*dist, self.cap, (size - i - 0.5) / size, above) for i in range(size)]

    def predict_many(self, prompts: Iterable[Prompt]) -> list[float]:
        """`predict` for each prompt, in order."""
        return [self.predict(p) for p in prompts]

    def predict_past(self, prompt: Prompt, tokens: float) -> float:
        """The predicted length of a running request of the prompt that already holds `tokens` tokens: with
        "lognormal", the expected length given that it is past them (and past its finished siblings), under
        the prompt's distribution, or under the prior's (a prompt without history) once its own gives that
        less than SHIFTED_P (the prompt has shifted: its history no longer describes it); else `predict`.
        Never below tokens + 1 (it has not ended)."""
        key = _key(prompt)
        dist = self._distribution(key) if self.statistic == "lognormal" and tokens > 0 else None
        if dist is None:
            return max(self.predict(prompt), float(tokens) + 1.0)
        above = max(float(tokens), *self._seen.get(key, [0]))
        prior = self._lognormal()[2]
        if prior is not None and 1.0 - NormalDist().cdf((math.log(above) - dist[0]) / dist[1]) < SHIFTED_P:
            dist = prior
        return max(expected_length(*dist, self.cap, above=above), float(tokens) + 1.0)

    def _distribution(self, key: str) -> tuple[float, float] | None:
        """(mu, sigma) of the prompt's log-length: its own fit, else the prior; None before any record."""
        sigma, mus, prior = self._lognormal()
        return (mus[key], sigma) if key in mus else prior

    def _rollout_stats(self, key: str) -> list[Stats]:
        if key not in self._stats:
            self._stats[key] = [log_stats(r, self.cap) for r in self._history[key]]
        return self._stats[key]

    def _location(self, stats: list[Stats], sigma: float) -> float:
        """A prompt's level: fitted to all its remembered rollouts, or to its last one alone when that one
        moved from the older ones by more than SHIFT_Z standard errors (a rank shift: the older rollouts
        would drag the prediction back to where the prompt was)."""
        every = fit_stats(merged(stats), sigma, self.cap)
        if len(stats) < 2:
            return every
        older = merged(stats[:-1])
        last = fit_stats(stats[-1], sigma, self.cap)
        error = sigma * math.sqrt(1 / (stats[-1][0] + stats[-1][3]) + 1 / (older[0] + older[3]))
        return last if abs(last - fit_stats(older, sigma, self.cap)) > SHIFT_Z * error else every

    def _lognormal(self) -> tuple[float, dict[str, float], tuple[float, float] | None]:
        """The censored fit of every prompt (cached until the next record): the pooled within-prompt sigma,
        each prompt's location, and the prior (mu, sigma) of a prompt without history (None: no data)."""
        if self._fit is None:
            # the spread inside a group (each rollout around its own level: a prompt's shift is not spread)
            stats = {k: self._rollout_stats(k) for k in self._history}
            sigma = pooled_stats([r for per_rollout in stats.values() for r in per_rollout])
            mus = {k: self._location(per_rollout, sigma) for k, per_rollout in stats.items()}
            prior = None
            if mus:
                mean = sum(mus.values()) / len(mus)
                spread = sum((m - mean) ** 2 for m in mus.values()) / len(mus)
                prior = (mean, math.sqrt(sigma * sigma + spread))
            self._fit = (sigma, mus, prior)
        return self._fit


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
