"""Response lengths as a lognormal cut at the length cap: the fit and the expectations the predictor needs
(docs/design.md, section 4, "HistoPipe, part by part": Prediction). Torch-free, stdlib only.

A response that stopped at `max_completion_length` did not end there: its length is a lower bound (right-
censored). Averaging it as if it were its length ties every prompt whose responses hit the cap (the shipped
trace: 54% at the cap, rank correlation -0.1). So each prompt's log-lengths are fitted as a normal with a
location of its own and a spread shared by every prompt (`pooled_sigma`), the censored ones by EM (their
expected value given that they lie past the cap replaces them until the location settles): a prompt with
more responses at the cap ranks longer than one with fewer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

_N = NormalDist()
SIGMA_MIN = 1e-3  # a floor on the spread, so that the normal's maths stays defined
EM_ROUNDS = 30  # the EM for one prompt's location converges to 1e-6 well within this on 32 observations


def _upper_mean(a: float) -> float:
    """E[Z | Z > a] for a standard normal Z (the inverse Mills ratio), stable far in the tail."""
    tail = 1.0 - _N.cdf(a)
    if tail < 1e-12:  # far past the mean: the ratio tends to a + 1/a
        return a + 1.0 / max(a, 1e-6)
    return _N.pdf(a) / tail


Stats = tuple[int, float, float, int]  # (uncensored count, their log-lengths' sum, sum of squares, censored count)


def log_stats(lengths: Sequence[float], cap: float | None) -> Stats:
    """What the fits need of some lengths (those >= `cap` censored), kept per rollout by the predictor so that
    a refit does not take logarithms again."""
    logs = [math.log(max(float(n), 1.0)) for n in lengths if cap is None or n < cap]
    return len(logs), sum(logs), sum(y * y for y in logs), len(lengths) - len(logs)


def merged(stats: Sequence[Stats]) -> Stats:
    """The stats of several sets of lengths together."""
    return (sum(x[0] for x in stats), sum(x[1] for x in stats), sum(x[2] for x in stats), sum(x[3] for x in stats))


def fit_location(lengths: Sequence[float], sigma: float, cap: float | None) -> float:
    """The location mu (of log-lengths) of a normal with spread `sigma` fitted to `lengths`, those >= `cap`
    censored (lower bounds), by EM. All censored: the location is held at log(cap) + sigma, a length past
    the cap whose size nothing recorded can tell."""
    return fit_stats(log_stats(lengths, cap), sigma, cap)


def fit_stats(stats: Stats, sigma: float, cap: float | None) -> float:
    """`fit_location` from `log_stats`."""
    seen_n, seen, _, censored = stats
    if censored == 0:
        return seen / seen_n
    c = math.log(cap)
    if seen_n == 0:
        return c + sigma
    total = seen_n + censored
    mu = (seen + censored * c) / total
    for _ in range(EM_ROUNDS):
        past = mu + sigma * _upper_mean((c - mu) / sigma)  # E[log length | past the cap]
        new = (seen + censored * past) / total
        if abs(new - mu) < 1e-9:
            break
        mu = new
    return min(mu, c + sigma)


def pooled_sigma(groups: Sequence[Sequence[float]], cap: float | None, default: float = 0.5) -> float:
    """The spread of log-lengths around each group's own level, pooled over groups: the standard deviation
    of every uncensored log-length around its group's mean (groups with at least two). `default` when
    fewer than two degrees of freedom remain; at least `SIGMA_MIN` (lengths that never vary). Censored lengths
    are left out, which biases it a little low."""
    return pooled_stats([log_stats(g, cap) for g in groups], default)


def pooled_stats(stats: Sequence[Stats], default: float = 0.5) -> float:
    """`pooled_sigma` from each group's `log_stats`."""
    ss, dof = 0.0, 0
    for n, total, squares, _ in stats:
        if n >= 2:
            ss += max(squares - total * total / n, 0.0)
            dof += n - 1
    return max(math.sqrt(ss / dof), SIGMA_MIN) if dof >= 2 else default


def expected_length(mu: float, sigma: float, cap: float | None, above: float = 0.0) -> float:
    """E[min(X, cap) | X > above] for X lognormal(mu, sigma): a request's expected length once cut at the cap,
    given that it has already run past `above` tokens (0: nothing known)."""
    s2 = sigma * sigma
    mean = math.exp(mu + s2 / 2)
    lo = math.log(above) if above > 0 else -math.inf
    p_above = 1.0 - _N.cdf((lo - mu) / sigma) if above > 0 else 1.0
    if p_above < 1e-12:  # nothing of this distribution is that long: it is at least `above`
        return min(float(above), cap) if cap is not None else float(above)
    a = _N.cdf((lo - mu - s2) / sigma) if above > 0 else 0.0
    if cap is None:
        return mean * (1.0 - a) / p_above
    c = math.log(cap)
    if above >= cap:
        return float(cap)
    body = mean * (_N.cdf((c - mu - s2) / sigma) - a)
    return (body + cap * (1.0 - _N.cdf((c - mu) / sigma))) / p_above


def quantile_length(mu: float, sigma: float, cap: float | None, q: float, above: float = 0.0) -> float:
    """The q-quantile of min(X, cap) given X > above, X lognormal(mu, sigma)."""
    lo = _N.cdf((math.log(above) - mu) / sigma) if above > 0 else 0.0
    p = min(max(lo + q * (1.0 - lo), 1e-12), 1 - 1e-12)
    x = math.exp(mu + sigma * _N.inv_cdf(p))
    return min(x, cap) if cap is not None else x
