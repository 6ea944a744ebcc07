"""The censored predictor (`histopipe.censored`, `LengthPredictor(statistic="lognormal")`): a length at the
cap is a lower bound; the fit against a brute-force maximum likelihood; the fallbacks for prompts without
history (the data set's prior, then the siblings finished so far); a rank shift detected."""

import math
from statistics import NormalDist

import pytest

from rhymerl.history import HistoryStore
from rhymerl.histopipe.censored import expected_length, fit_location, pooled_sigma, quantile_length
from rhymerl.histopipe.predict import LengthPredictor

N = NormalDist()


def censored_loglik(mu, lengths, sigma, cap):
    """The reference: log-likelihood of log-lengths ~ N(mu, sigma), lengths >= cap only known to be there."""
    total = 0.0
    for n in lengths:
        if n >= cap:
            total += math.log(max(1 - N.cdf((math.log(cap) - mu) / sigma), 1e-300))
        else:
            total += math.log(N.pdf((math.log(n) - mu) / sigma))
    return total


def test_fit_matches_brute_force_maximum_likelihood():
    lengths, sigma, cap = [40, 90, 128, 128, 128, 70, 128, 55], 0.6, 128
    grid = [3.0 + i * 0.0005 for i in range(6000)]
    best = max(grid, key=lambda mu: censored_loglik(mu, lengths, sigma, cap))
    assert fit_location(lengths, sigma, cap) == pytest.approx(best, abs=1e-3)
    # uncensored: the mean of the logs; the cut raises it
    plain = sum(math.log(n) for n in lengths) / len(lengths)
    assert fit_location(lengths, sigma, None) == pytest.approx(plain)
    assert fit_location(lengths, sigma, cap) > plain + 0.1
    assert fit_location([128] * 4, sigma, cap) == pytest.approx(math.log(128) + sigma)  # all cut: held


def test_a_length_at_the_cap_is_a_lower_bound():
    p = LengthPredictor(cap=128)
    p.record("all_cut", [128] * 8)
    p.record("half_cut", [128] * 4 + [100] * 4)
    p.record("none_cut", [100] * 8)
    a, b, c = p.predict_many(["all_cut", "half_cut", "none_cut"])
    assert a > b > c and a <= 128  # ranked by how many were cut, never past the cap
    # the quantile statistic ties the first two (what the shipped trace's 54% at the cap did)
    q = LengthPredictor(statistic=0.75)
    q.record("all_cut", [128] * 8)
    q.record("half_cut", [128] * 4 + [100] * 4)
    assert q.predict("all_cut") == q.predict("half_cut") == 128


def test_expectations_match_their_formulas():
    mu, s = math.log(1000), 0.5
    assert expected_length(mu, s, None) == pytest.approx(math.exp(mu + s * s / 2))
    # cut at the median: E[min(X, c)] by numerical integration of the density
    cap = 1000.0
    xs = [math.exp(mu + s * (-8 + i * 0.001)) for i in range(16000)]
    dens = [N.pdf(-8 + i * 0.001) * 0.001 for i in range(16000)]
    numeric = sum(min(x, cap) * d for x, d in zip(xs, dens))
    assert expected_length(mu, s, cap) == pytest.approx(numeric, rel=1e-3)
    # given that it has run past 1,500 tokens: above 1,500, below the cap
    assert 1500 < expected_length(mu, s, 4000, above=1500) < 4000
    assert expected_length(mu, s, 4000, above=5000) == 4000
    qs = [quantile_length(mu, s, 4000, q) for q in (0.1, 0.5, 0.9)]
    assert qs[1] == pytest.approx(1000) and qs[0] < qs[1] < qs[2] <= 4000


def test_fallbacks_for_a_prompt_without_history():
    p = LengthPredictor(cap=16384, default_length=700)
    assert p.predict("new") == 700  # nothing recorded anywhere
    for i, level in enumerate((200, 400, 800, 1600)):
        p.record(f"p{i}", [level, level * 1.2, level / 1.2, level])
    prior = p.prior()
    assert p.predict("new") == prior
    assert 400 < prior < 1600  # the data set's levels, their spread added: near the middle, leaning long
    assert "new" not in p and "p0" in p
    p.observe_finished("new", 3000)  # a sibling finished at 3,000: the rest run longer
    assert p.predict("new") > 3000
    p.observe_finished("p0", 900)  # a prompt with history: conditioned the same way
    assert p.predict("p0") >= 900  # far past what its history knows: at least the finished sibling
    p.clear_observed()
    assert p.predict("new") == prior
    group = p.predict_group("p3", 8)
    assert group == sorted(group, reverse=True) and len(group) == 8
    assert sum(group) / 8 == pytest.approx(p.predict("p3"), rel=0.15)  # its quantiles average about its mean


def test_a_shifted_prompt_follows_its_last_rollout():
    p = LengthPredictor()
    for _ in range(3):
        p.record("shifted", [1000, 1100, 900, 1050])
        p.record("steady", [1000, 1100, 900, 1050])
    p.record("shifted", [8000, 8800, 7200, 8400])
    p.record("steady", [1020, 1080, 950, 1000])
    assert p.predict("shifted") > 7000  # not the mean of the four rollouts (~2,200)
    assert 900 < p.predict("steady") < 1200


def test_pooled_sigma_is_the_spread_inside_groups():
    groups = [[100 * math.exp(0.3 * z) for z in (-1, 1)], [5000 * math.exp(0.3 * z) for z in (-1, 1)]]
    assert pooled_sigma(groups, None) == pytest.approx(math.sqrt(2) * 0.3)  # two of one dof each: s.d. 0.3 sqrt 2
    assert pooled_sigma([[5]], None) == 0.5  # too little to tell: the default


def test_the_one_predictor_reads_a_history_store():
    store = HistoryStore(max_rollouts=4)
    store.record_rollout([1, 2], [[1] * 40, [1] * 60])
    store.record_rollout([3, 4], [[1] * 64, [1] * 64])
    p = LengthPredictor.from_history(store, cap=64)
    assert p.predict([3, 4]) > p.predict([1, 2])
