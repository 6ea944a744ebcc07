"""A seeded, calibrated length workload that rhymes: `rhymerl bench pipe --trace rhyming` (docs/design.md, section 4,
"HistoPipe, part by part": Workload). Torch-free, stdlib only.

Reasoning RL's rollouts, as published (each default's source in docs/design.md, "Workload"): response
lengths lognormal with a median of 1,500 tokens and a 99th percentile ~10x the median, cut at a 16,384-token
`max_completion_length`; 8 generations per prompt; the same prompts every epoch, their ranking by length
stable but for ~3% that move more than a quarter of the ranking between adjacent epochs; the mean length
growing ~30% over 100 steps. A step holds `waves` x workers x slots requests or more, so that each worker
admits several waves and admission order matters.

The model: prompt p has a level z_p (a standard normal; its log-length median is log(median) + sigma_b z_p),
its responses at global step t are exp(log(median) + sigma_b z_p + sigma_w e) x (1 + drift t / drift_steps),
e standard normal, cut at the cap. sigma_w (`group_spread`, the spread inside a group) is an assumption; sigma_b
makes the total spread give the p99 / median ratio. At each epoch a prompt makes a rank shift with probability
`shift_share`: its level moves to a quantile more than `shift_gap` away from its own. Every draw comes from
a stream keyed by (seed, prompt), so a step's lengths do not depend on which other steps were generated.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields
from statistics import NormalDist

_N = NormalDist()
_Z99 = _N.inv_cdf(0.99)


@dataclass(frozen=True)
class Rhyming:
    """The workload's parameters (each a `--rhyming-KEY VALUE` option of `rhymerl bench pipe`)."""

    median: float = 1500.0  # tokens, the median response length
    p99_ratio: float = 10.0  # the 99th percentile over the median (before the cut)
    cap: int = 16384  # max_completion_length: longer responses are cut here
    num_generations: int = 8  # responses per prompt (a GRPO group)
    shift_share: float = 0.03  # share of prompts whose level moves far at each epoch
    shift_gap: float = 0.30  # how far (as a share of the ranking) a shift moves at least: > a quarter + noise
    drift: float = 0.30  # the mean length grows by this share ...
    drift_steps: int = 100  # ... over this many steps (linearly)
    group_spread: float = 0.35  # sigma of the log-length inside one group (an assumption)
    waves: int = 4  # requests per step >= waves x workers x slots
    epoch_steps: int = 4  # steps per epoch: the data set is epoch_steps x prompts_per_step prompts
    history_epochs: int = 4  # epochs before the first simulated step (the predictor remembers 4 rollouts)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name in ("shift_share", "drift", "history_epochs", "group_spread") else 1e-9
            if not value >= low:
                raise ValueError(f"rhyming {f.name} must be >= {low:g}, got {value}")
        if self.shift_share > 1 or self.shift_gap >= 0.5:
            raise ValueError(f"rhyming shift_share must be <= 1 and shift_gap < 0.5, got {self.shift_share}, "
                             f"{self.shift_gap}")
        if self.group_spread >= self.total_sigma():
            raise ValueError(f"rhyming group_spread {self.group_spread} must be below the total log-length "
                             f"spread {self.total_sigma():.3f} that p99_ratio {self.p99_ratio} gives")

    def total_sigma(self) -> float:
        """The spread of every log-length together: p99 / median = exp(z_0.99 sigma)."""
        return math.log(self.p99_ratio) / _Z99

    def between_sigma(self) -> float:
        """The spread of the prompts' levels (log-length medians)."""
        return math.sqrt(self.total_sigma() ** 2 - self.group_spread ** 2)

    def prompts_per_step(self, workers: int, slots: int) -> int:
        """Prompts a step of `workers` x `slots` needs for `waves` waves."""
        return math.ceil(self.waves * workers * slots / self.num_generations)

    def first_step(self) -> int:
        """The first simulated step: the first of epoch `history_epochs`."""
        return self.history_epochs * self.epoch_steps

    def workload(self, prompts_per_step: int, seed: int = 0) -> "Workload":
        return Workload(self, prompts_per_step, seed)


class Workload:
    """The steps of one data set of `epoch_steps` x `prompts_per_step` prompts (`step(t)`)."""

    def __init__(self, params: Rhyming, prompts_per_step: int, seed: int = 0):
        self.params, self.per_step, self.seed = params, prompts_per_step, seed
        self.num_prompts = params.epoch_steps * prompts_per_step
        # prompt -> (its random stream, per epoch: (its level z, its group's log-length noises))
        self._prompts: dict[int, tuple[random.Random, list[tuple[float, list[float]]]]] = {}
        self._orders: dict[int, list[int]] = {}  # epoch -> the prompts in the order the sampler hands them out

    def order(self, epoch: int) -> list[int]:
        """The sampler's permutation of the data set in `epoch`."""
        if epoch not in self._orders:
            order = list(range(self.num_prompts))
            random.Random(f"{self.seed}:order:{epoch}").shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch]

    def _epoch(self, prompt: int, epoch: int) -> tuple[float, list[float]]:
        """Prompt `prompt`'s level z (a standard normal) in `epoch` and its group's noises: one keyed stream
        per prompt, drawn epoch after epoch, so that any query order gives the same values."""
        if prompt not in self._prompts:
            self._prompts[prompt] = (random.Random(f"{self.seed}:prompt:{prompt}"), [])
        rng, epochs = self._prompts[prompt]
        p = self.params
        while len(epochs) <= epoch:
            if not epochs:
                z = rng.gauss(0.0, 1.0)
            else:
                z = epochs[-1][0]
                shift, u = rng.random(), rng.random()  # both drawn every epoch: the stream stays aligned
                if shift < p.shift_share:  # a rank shift: a new quantile uniform over [0, 1] less (q +- gap)
                    q, gap = _N.cdf(z), p.shift_gap
                    below, above = max(q - gap, 0.0), max(1.0 - (q + gap), 0.0)
                    u *= below + above
                    new = u if u < below else q + gap + (u - below)
                    z = _N.inv_cdf(min(max(new, 1e-9), 1 - 1e-9))
            epochs.append((z, [rng.gauss(0.0, p.group_spread) for _ in range(p.num_generations)]))
        return epochs[epoch]

    def level(self, prompt: int, epoch: int) -> float:
        """Prompt `prompt`'s level z in `epoch` (see the module doc)."""
        return self._epoch(prompt, epoch)[0]

    def lengths(self, prompt: int, epoch: int, step: int) -> list[int]:
        """The group's response lengths of `prompt` in `epoch`, run at global step `step` (for the drift)."""
        p = self.params
        z, noise = self._epoch(prompt, epoch)
        mu = math.log(p.median) + p.between_sigma() * z
        scale = 1.0 + p.drift * step / p.drift_steps
        return [min(p.cap, max(1, round(math.exp(mu + e) * scale))) for e in noise]

    def step(self, t: int) -> list[tuple[str, list[int]]]:
        """Global step t's groups, in the sampler's order: (prompt key, its response lengths)."""
        epoch, s = divmod(t, self.params.epoch_steps)
        prompts = self.order(epoch)[s * self.per_step:(s + 1) * self.per_step]
        return [(f"r{p}", self.lengths(p, epoch, t)) for p in prompts]

    def trace(self, steps: int) -> list[dict]:
        """Steps 0..steps-1 as the rows of a length trace (`histopipe.trace`): {"step", "groups"}."""
        return [{"step": t, "groups": [{"prompt": k, "lengths": ls} for k, ls in self.step(t)]}
                for t in range(steps)]
