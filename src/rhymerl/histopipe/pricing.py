"""What the planner counts a request's work in when HistoSpec decodes it: plain full-batch steps, not tokens
(docs/design.md, section 4, "HistoPipe, part by part": Pricing, with the notebook entries it cites).

Without speculation a sequence commits one token per forward, and a step of n sequences costs `cost(n, n)`:
the planner's worker model (`batching.worker_time`) on token counts is then exact. With HistoSpec:

- a request commits several tokens per forward it takes part in, at its prompt's rate: answers that its
  history or its siblings draft well take far fewer forwards per token (1.0 to 5.5 on the recorded
  `repeat` workload);
- a forward costs what its tokens fed cost: on a CPU a 12-row step verifying 4 drafts a row costs about 2.9x
  a plain one, so a worker's seconds follow its forwards weighed by their width (per call, the two workers'
  busy seconds were off by 0.10 in |log| from their cost-model seconds' ratio, by 0.33 from their forwards');
- a small batch's forward is filled with drafts, so `cost(n, n)` pricing a one-sequence tail at a third of
  a full step is wrong too.

So a request's price is its predicted length over its prompt's tokens per step (a forward counted as its
full-batch `CostModel.step` over a plain one's), and a step's price is a full plain batch's
(`speculative_step_cost`). With speculation off every rate is 1 and the cost model is used as it is: one
model, of which token pricing is the special case the simulator runs.

A prompt's rate as the calls measure it (`TokensPerForward`, from `RequestOutput.forwards`) follows the
drafting of the worker that ran it, which follows that worker's timing (its online correction, the pause
when drafts stop paying): four runs on the same tokens gave one prompt 1.07, 2.26, 1.43 and 2.35 tokens per
forward, and the plan built on them changed from run to run. So the pool's default (`ReplayedRates`) counts
a prompt's rate from its recorded tokens alone, which keyed sampling makes the same in every run: its
responses decoded again by HistoSpec's drafter, budget and calibration (`replay.Replay`); with the same
history, cost model and slots the plan is the same whatever the timing of the calls that recorded it.
`TokensPerForward` (the calls' own rates, shrunk toward the mean by the forwards that back them: (tokens +
K x mean) / (forwards + K), K = `PRIOR_FORWARDS`, the noise per forward over the spread of true rates)
stays as the pool's `pricing="measured"`, in forwards.
"""

from __future__ import annotations

from collections.abc import Sequence

from rhymerl.cost_model import CostModel
from rhymerl.histopipe.batching import Cost
from rhymerl.histopipe.replay import Replay, Replayed
from rhymerl.history import HistoryStore, prompt_key

MIN_RATE = 1.0  # a request commits at least its token per forward (a rate below is prefill's share)
# The prior's weight in forwards: a prompt's own rate counts as much as the pool's mean once this many
# (decayed) forwards back it. Measured on the recorded workload (module doc): run-to-run variance of a
# prompt's rate x its forwards over the variance of the prompts' true rates, 105 to 143.
PRIOR_FORWARDS = 120.0


class TokensPerForward:
    """Per prompt, the tokens a request committed per forward it took part in, over the last calls that ran
    the prompt (`observe`), shrunk toward the mean over every prompt seen by `prior_forwards` (see the module
    doc; 0: the prompt's own rate); `rate(prompt)` is that mean for a prompt never seen, else 1.0 (token
    pricing). `decay`: the weight of the older calls against the newest (0: the newest alone)."""

    def __init__(self, decay: float = 0.5, prior_forwards: float = PRIOR_FORWARDS):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if prior_forwards < 0:
            raise ValueError(f"prior_forwards must be >= 0, got {prior_forwards}")
        self.decay, self.prior_forwards = decay, prior_forwards
        self._rates: dict[str, tuple[float, float]] = {}  # prompt key -> (decayed tokens, decayed forwards)

    def observe(self, outputs) -> None:
        """A call's outputs (`RequestOutput`s: prompt_ids, token_ids, forwards); one without forwards counted
        (an error, a bare engine) is left out."""
        call: dict[str, list[int]] = {}
        for o in outputs:
            if o.forwards > 0 and o.token_ids:
                t = call.setdefault(prompt_key(o.prompt_ids), [0, 0])
                t[0] += len(o.token_ids)
                t[1] += o.forwards
        for key, (tokens, forwards) in call.items():
            old_t, old_f = self._rates.get(key, (0.0, 0.0))
            self._rates[key] = (self.decay * old_t + tokens, self.decay * old_f + forwards)

    def rate(self, prompt_ids: Sequence[int]) -> float:
        """The prompt's tokens per forward shrunk toward the mean of all prompts' (at least MIN_RATE); the mean
        when it has none."""
        if not self._rates:
            return MIN_RATE
        tokens = sum(t for t, _ in self._rates.values())
        mean = tokens / max(sum(f for _, f in self._rates.values()), 1e-9)
        got = self._rates.get(prompt_key(prompt_ids))
        if got is None:
            return max(MIN_RATE, mean)
        return max(MIN_RATE, (got[0] + self.prior_forwards * mean) / (got[1] + self.prior_forwards))

    def forwards(self, prompt_ids: Sequence[int], predicted: Sequence[float]) -> list[float]:
        """Predicted lengths (tokens) of the prompt's requests as predicted forwards."""
        r = self.rate(prompt_ids)
        return [p / r for p in predicted]

    def state_dict(self) -> dict:
        return {"decay": self.decay, "prior_forwards": self.prior_forwards,
                "rates": {k: list(v) for k, v in self._rates.items()}}


# The tokens of a prompt's responses `ReplayedRates` replays at most, each response cut to its share: the
# replay runs in the driver in pure Python (HistoSpec's drafter and budget at every replayed forward, twice:
# `Replay.warm`, then the count; about 0.35 s for the recorded workload's 4,442 tokens on a Zen 4 core), so a
# 128-prompt call of 8 x 1,500-token histories costs ~20 s, not ~150; the rate is then the first tokens'.
MAX_REPLAYED_TOKENS = 2048
UNITS = ("forwards", "steps")  # what `ReplayedRates` counts a prompt's tokens against


class ReplayedRates:
    """Per prompt, its tokens per unit of work as its recorded responses replay under HistoSpec's drafting
    (`replay.Replay`: its drafter on `SuffixIndex`es, its budget under the cost model for a full batch of
    `slots`, its calibration warmed on the call's prompts): `unit="forwards"`, tokens per forward;
    `unit="steps"`, tokens per plain full-batch step's worth of cost model seconds (a forward verifying a
    wide draft counts as the `CostModel.step` it costs over a plain one's), the unit a worker's seconds
    follow when a wide step costs several plain ones (docs/design.md, section 4, Pricing). Counted from
    tokens and the cost model only, so the same in every run (module doc). A prompt without history takes
    the mean of the call's prompts with one (tokens over units), else MIN_RATE; each prompt's responses are
    cut to MAX_REPLAYED_TOKENS in all."""

    def __init__(self, max_draft_tokens: int, unit: str = "steps"):
        if max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {max_draft_tokens}")
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
        self.max_draft, self.unit = max_draft_tokens, unit

    def replay(self, history: HistoryStore, prompts: Sequence[Sequence[int]], cost: Cost,
               slots: int) -> list[list[Replayed] | None]:
        """Per prompt, its responses replayed (None: no history): the calibration warmed on all of them first.
        A cost that is not a `CostModel` (a plain callable) is read as one on its (tokens, seqs)."""
        model = cost if isinstance(cost, CostModel) else _AsModel(cost)
        replay = Replay(model, slots, self.max_draft)
        cut = []
        for p in prompts:
            responses = [r for r in history.responses(p) if r]
            share = max(MAX_REPLAYED_TOKENS // max(len(responses), 1), 16)
            cut.append([r[:share] for r in responses])
        for p, responses in zip(prompts, cut):
            replay.warm(p, responses)
        return [replay.prompt(p, responses) if responses else None for p, responses in zip(prompts, cut)]

    def rates(self, history: HistoryStore, prompts: Sequence[Sequence[int]], cost: Cost, slots: int) -> list[float]:
        """Each prompt's tokens per unit (at least MIN_RATE), in order."""
        counted = [None if r is None else (sum(x.tokens for x in r),
                                           sum(x.forwards if self.unit == "forwards" else x.units for x in r))
                   for r in self.replay(history, prompts, cost, slots)]
        backed = [c for c in counted if c is not None]
        tokens, work = sum(t for t, _ in backed), sum(w for _, w in backed)
        mean = tokens / work if work else MIN_RATE
        return [max(MIN_RATE, mean if c is None else c[0] / max(c[1], 1e-9)) for c in counted]


class _AsModel:
    """A plain cost callable (tokens, seqs) -> seconds read as a `CostModel`'s `step`."""

    def __init__(self, cost: Cost):
        self.cost = cost

    def step(self, base_tokens: int, seqs: int, draft_tokens: int = 0, longest_draft: int = 0) -> float:
        return self.cost(base_tokens + draft_tokens, seqs)


class FlatStepCost:
    """A step's price whatever its sequences (see the module doc): `cost(slots, slots)`, a full batch of
    one-token rows on `cost`'s own grid. Callable like a `CostModel`."""

    def __init__(self, cost: Cost, slots: int):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.seconds = float(cost(slots, slots))

    def __call__(self, tokens: int, seqs: int = 1) -> float:
        return self.seconds


def speculative_step_cost(cost: Cost, slots: int, speculative: bool) -> Cost:
    """The step cost the planner uses: `FlatStepCost` under HistoSpec, `cost` itself without speculation."""
    return FlatStepCost(cost, slots) if speculative else cost
