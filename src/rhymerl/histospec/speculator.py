"""HistoSpec inside the engine: which drafts a step verifies, and what it learns from the verified ones.

The engine talks to it through two calls a step:

- `propose(seqs, rooms, base_tokens, draining)`: a draft tree per sequence (often empty). Every decoding
  sequence asks the drafter for a token tree (history -> siblings -> self); the measured cost model then keeps
  only the draft nodes whose expected acceptances buy more than the forward time they add (`budget`).
- `commit(seqs, drafts, verified, appended, step_seconds, batch_done)`: after the engine's forward and the
  acceptance walk (`verify`), the statistics, the edge calibration, the draft-length rules, the sibling and
  self indexes, and the measured step time.
"""

from __future__ import annotations

import time

from rhymerl.cost_model import CostModel
from rhymerl.histospec import budget
from rhymerl.histospec.budget import PROBE_EVERY, PROBE_NODES, PROBE_SPEND, is_probe_step
from rhymerl.histospec.calibration import MATCH_CLASSES, EdgeCalibration, match_class
from rhymerl.histospec.drafter import Draft, Drafter
from rhymerl.histospec.history_index import HistoryIndex
from rhymerl.histospec.seq_state import DraftingSequence, SeqSpec, SiblingGroup, tail
from rhymerl.histospec.stats import SpecStats
from rhymerl.histospec.suffix_index import SuffixIndex
from rhymerl.histospec.verify import Verified
from rhymerl.history import HistoryStore

SPECULATIVE_MODES = ("histospec", "off")  # rollout.speculative: HistoSpec's drafts, or plain decoding (no Speculator)
SIBLING_PROMPT_TOKENS = 8  # the end of the prompt goes in front of each sibling, so first tokens can match
# The drafter matches up to MATCH_WINDOW recent tokens. A longer match tells apart sources that agree on the
# last 7 tokens but not before: two responses caught in similar loops, or a history response that shares a
# phrase but not the sentence. On the T=0.3 tail a 15-token window took clearly fewer forwards than 7
# (docs/notebook, bench spec at 021876b); 23 gained nothing more.
MATCH_WINDOW = 15


class Speculator:
    """HistoSpec's state in one engine: the drafter over `history`, the sibling groups of the running batch,
    the edge calibration, the step-level pause and the online correction of the cost model."""

    def __init__(self, cost: CostModel | None, history: HistoryStore | None = None, rule: str = "cost",
                 max_draft_tokens: int = 32, eos_token_ids=(), max_branches: int = 4,
                 correct_cost: bool | None = None, reward_weighted: bool = False):
        """`cost`: the forward-cost model; None = the one the engine running this speculator measures
        (`attach`). `correct_cost`: learn measured/predicted step time online (`observe_step`); None = for a
        measured cost model (this engine's, or one another engine measured on the same model and slots), not
        for one written by hand. `reward_weighted`: branches of the history that higher-reward responses took
        come first (the drafter's reward weighting, `rollout.reward_aware_drafting`); the same tokens either
        way. The drafts stop at `eos_token_ids`, which the engine sets (`attach`)."""
        self.cost = cost
        self.correct_cost = correct_cost if correct_cost is not None or cost is None else cost.measured
        self.history = history  # the store drafts come from; its indexes, built and cached:
        self.indexes = HistoryIndex(history) if history is not None else None
        self.rule = budget.length_rule(rule, max_draft_tokens)
        self.drafter = Drafter(self.indexes, max_tokens=max_draft_tokens, max_depth=max_draft_tokens,
                               max_branches=max_branches, max_window=MATCH_WINDOW, eos_token_ids=eos_token_ids,
                               reward_weighted=reward_weighted)
        self.max_draft_tokens = max_draft_tokens
        self.groups: dict[object, SiblingGroup] = {}  # group key -> the siblings' index
        self.stats = SpecStats()
        self.calibration = EdgeCalibration(max_draft_tokens)
        # Consecutive steps (per batch-size bucket) whose drafts did not pay for the drafting (a zero budget,
        # or an expected saving below the drafting time): after PROBE_EVERY of them, drafting itself is
        # skipped except on probe steps (`is_probe_step`).
        self._idle: dict[int, int] = {}
        # Measured / predicted step time, for drafting and for plain steps, per batch-size bucket: a real
        # step costs more than the calibration shape (sampling per tree level, mixed groups), and more so
        # when it drafts; the decision compares corrected costs. Updated by `observe_step`.
        self._ratio: dict[tuple[int, bool], float] = {}
        # With a padded (GPU) cost model, measured minus predicted step time instead, less the drafting
        # (`budget.host_seconds`): a GPU step's time outside its forward is a fixed cost, not a ratio.
        self._host: dict[tuple[int, bool], float] = {}
        self._pending: tuple | None = None

    def attach(self, eos_token_ids, measure_cost) -> None:
        """Called once by the engine that runs this speculator: its EOS ids (a draft stops at one), and, when
        built without a cost model, `measure_cost()` measures one on that engine."""
        self.drafter.eos_token_ids = frozenset(eos_token_ids)
        if self.cost is None:
            self.cost = measure_cost()
            self.correct_cost = self.cost.measured if self.correct_cost is None else self.correct_cost

    def end_batch(self) -> None:
        """No request of the batch is left in the engine: the sibling indexes, which live as long as it, go."""
        self.groups.clear()

    # ---- what it learned, as plain data (saved with a training checkpoint) -----------------------
    def state_dict(self) -> dict:
        """What this speculator learned across rollouts, as JSON-able data: the edge calibration, the cost
        model (measured or given) and its online correction ratios, the step-level idle counters. A resumed
        run loads it (`load_state_dict`) so that it drafts as the uninterrupted run would have. Per-batch
        state (sibling indexes, per-sequence lengths) ends with each rollout and is not part of it."""
        return {"calibration": self.calibration.state_dict(), "cost": self.cost.as_dict(),
                "correct_cost": self.correct_cost, "idle": [[b, n] for b, n in sorted(self._idle.items())],
                "ratio": [[b, d, r] for (b, d), r in sorted(self._ratio.items())],
                "host": [[b, d, s] for (b, d), s in sorted(self._host.items())]}

    def load_state_dict(self, state: dict) -> None:
        """The inverse of `state_dict`. Without a "cost" entry the current cost model is kept; a
        calibration for another `max_draft_tokens` is not loaded (it starts afresh)."""
        if "cost" in state:
            self.cost = CostModel.from_dict(state["cost"])
            self.correct_cost = bool(state.get("correct_cost", self.cost.measured))
        cal = state.get("calibration")
        if cal is not None and all(len(r) == self.max_draft_tokens + 1 for r in cal["num"]):
            self.calibration.load_state_dict(cal)
        self._idle = {int(b): int(n) for b, n in state.get("idle", [])}
        self._ratio = {(int(b), bool(d)): float(r) for b, d, r in state.get("ratio", [])}
        self._host = {(int(b), bool(d)): float(s) for b, d, s in state.get("host", [])}
        self._pending = None

    # ---- the engine's two calls a step ----------------------------------------------------------
    def propose(self, seqs: list[DraftingSequence], rooms: list[int], base_tokens: int,
                draining: bool) -> list[Draft]:
        """A draft per sequence of the step (empty for most). `rooms[i]`: how deep sequence i may draft (0 for
        a sequence still prefilling, or with no room left); the step feeds `base_tokens` tokens without
        drafts; `draining`: no request waits for a slot (see `plan`)."""
        for seq in seqs:
            if seq.spec is None:
                seq.spec = self.start(seq.group, seq.prompt_ids)
        drafts = [Draft()] * len(seqs)
        drafting = [i for i, room in enumerate(rooms) if room > 0]
        if not drafting or self.drafting_paused(len(seqs)):
            return drafts
        window = self.drafter.max_window  # the recent tokens the drafter matches
        proposed = self.plan([tail(seqs[i], window) for i in drafting], [seqs[i].spec for i in drafting],
                             base_tokens, len(seqs), draining=draining, max_depths=[rooms[i] for i in drafting])
        for i, d in zip(drafting, proposed):
            drafts[i] = d
        return drafts

    def commit(self, seqs: list[DraftingSequence], drafts: list[Draft], verified: list[Verified],
               appended: list[list[int]], started: float, batch_done: bool) -> None:
        """At the end of a step: each sequence's verified draft (`verified[i].path`) and the tokens it
        appended (`appended[i]`, the verified tokens cut at a finish); `started`: the step's start
        (time.perf_counter), for its measured time; `batch_done`: no request is left, so the sibling
        indexes, which live as long as the batch, go."""
        for seq, draft, v, new in zip(seqs, drafts, verified, appended):
            self.record(seq.spec, draft, v.path, kept=len(new))
            self.observe(seq.spec, new)
        if batch_done:
            self.end_batch()
        self.observe_step(time.perf_counter() - started)

    # ---- pieces of the two calls ---------------------------------------------------------------
    def start(self, group_key, prompt_ids: list[int]) -> SeqSpec:
        """A sequence's state, made when it first takes part in a step."""
        group = self.groups.setdefault(group_key, SiblingGroup())
        own = SuffixIndex()
        own.add(prompt_ids)
        sid = group.index.add(prompt_ids[-SIBLING_PROMPT_TOKENS:])
        history = self.indexes.index(prompt_ids) if self.indexes is not None else None
        return SeqSpec(own, group, sid, history, self.rule.start)

    def observe(self, spec: SeqSpec, new_tokens: list[int]) -> None:
        """The tokens a sequence committed this step, for its own and its group's index (buffered until the
        next draft reads them: `SeqSpec.flush`)."""
        spec.unindexed += new_tokens
        spec.group.unindexed.setdefault(spec.sibling_id, []).extend(new_tokens)

    def drafting_paused(self, seqs: int) -> bool:
        """Whether this step (with `seqs` sequences) skips drafting because drafts stopped paying and it is
        not a probe step (`is_probe_step`). A paused step counts as one more zero-budget step; call
        `plan` only when this says False."""
        bucket = seqs.bit_length()
        idle = self._idle.get(bucket, 0)
        if is_probe_step(idle):
            return False
        self._idle[bucket] = idle + 1
        self._pending = None
        return True

    def plan(self, contexts: list[list[int]], specs: list[SeqSpec], base_tokens: int, seqs: int,
             draining: bool = False, max_depths: list[int] | None = None) -> list[Draft]:
        """Drafts for the decoding sequences (their recent tokens in `contexts`), cut to what maximises
        expected committed tokens per second of forward time; `seqs` sequences feed `base_tokens` tokens
        without drafts; `max_depths`: per sequence, how deep its draft may go (default: no limit beyond the
        drafter's). Nothing (plain decoding) wins whenever drafts do not pay (a full batch, poor
        matches, high temperature). Which nodes compete depends on `draining`:

        - requests still waiting for a slot (False): the step's most valuable nodes, whichever sequences
          they belong to (`budget.top_nodes`). Any committed token is worth the same then, so throughput is
          what counts, and a copying sequence drafts deep while a poorly matched one drafts nothing.
        - nothing waiting (True, the drain): a cap c on every sequence's draft (`budget.uniform_cap`). The
          slowest sequence now decides when the rollout ends, and it is typically the poorly matched
          one, which a budget by value alone would starve.

        Measured with `rhymerl bench spec` (docs/notebook, bench spec at e908d1a)."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        bucket = seqs.bit_length()
        idle = self._idle.get(bucket, 0)
        drafts, skipped = self._draft_each(contexts, specs, max_depths or [None] * len(specs))
        ranked, order = self._rank(drafts)
        # measured/predicted time of drafting steps relative to plain ones, or on a GPU the measured time
        # outside the priced forward and draws, plain and drafting (observe_step)
        plain_ratio = self._ratio.get((bucket, False), 1.0)
        scale = self._ratio.get((bucket, True), 1.0) / plain_ratio
        host_plain, host = (budget.host_seconds(self._host, bucket, d) for d in (False, True))
        plain_cost = self.cost.step(base_tokens, seqs) + host_plain

        def step_cost(n: int, longest: int = 0) -> float:  # this step with n draft tokens, the longest draft `longest`
            return self.cost.step(base_tokens, seqs, n, longest) * scale + host

        choose = budget.uniform_cap if draining else budget.top_nodes
        keep, extra = choose(ranked, step_cost, len(contexts) / plain_cost)
        # the pause weighs the saving against measured seconds, so it prices the steps in measured seconds too
        # (the model's x the plain steps' measured/predicted ratio; a GPU's padded model adds `host` instead)
        pays = self._pays(ranked, keep, plain_cost * plain_ratio,
                          step_cost(extra, max(keep, default=0)) * plain_ratio, cpu0)
        if idle >= PROBE_EVERY and not pays:  # a probe that finds drafts still do not pay: explore
            limit = (1 + PROBE_SPEND) * step_cost(extra)  # (PROBE_NODES); the step still counts as idle
            extra += budget.explore(ranked, keep, sum(step_cost(extra + j) <= limit
                                                      for j in range(1, PROBE_NODES + 1)))
        self._count_rounds(specs, keep, skipped)
        self._idle[bucket] = 0 if pays else idle + 1
        out = [budget.prune(d, set(o[:n])) for d, o, n in zip(drafts, order, keep)]
        elapsed = time.perf_counter() - t0
        self._count_draft_time(elapsed, specs, skipped)
        self._pending = (bucket, any(keep), self.cost.step(base_tokens, seqs, extra, max(keep, default=0)), elapsed)
        return out

    # ---- the parts of `plan` ------------------------------------------------------------------------
    def _draft_each(self, contexts: list[list[int]], specs: list[SeqSpec],
                    max_depths: list[int | None]) -> tuple[list[Draft], list[bool]]:
        """Each sequence's draft tree (empty for one sitting out: `SeqSpec.drafts_now`), and which sat out."""
        drafts, skipped = [], []
        for ctx, s, depth in zip(contexts, specs, max_depths):
            skipped.append(not s.drafts_now())
            if skipped[-1]:
                drafts.append(Draft())
            else:
                s.flush()
                drafts.append(self.drafter.draft(ctx, history=s.history, siblings=s.group.index, own=s.own,
                                                 max_tokens=s.length, max_depth=depth))
        return drafts, skipped

    def _rank(self, drafts: list[Draft]) -> tuple[list[list[float]], list[list[int]]]:
        """Each draft's node values, most valuable first, and the node indices in that order. A node's value,
        its path probability discounted by depth and match class (`EdgeCalibration.discounts`), is never above
        its parent's, and ties go to the lower index (parents first): every prefix is a rooted subtree."""
        reach = [self.calibration.discounts(c) for c in range(MATCH_CLASSES)]
        discounts = [reach[match_class(d.match_len)] for d in drafts]
        values = [[p * r[k] for p, k in zip(d.probs, d.depths())] for d, r in zip(drafts, discounts)]
        order = [sorted(range(len(v)), key=lambda j: (-v[j], j)) for v in values]
        return [[v[j] for j in o] for v, o in zip(values, order)], order

    @staticmethod
    def _pays(ranked: list[list[float]], keep: list[int], plain_cost: float, kept_cost: float, cpu0: float) -> bool:
        """Whether proposing paid, for the step-level pause: the time the kept drafts are expected to save
        (plain decoding would take longer to commit the same tokens; `kept_cost`: the step's predicted time
        with them) must exceed the time drafting took since `cpu0`. The kept drafts are verified either way, but
        a step that saves less counts as idle: at a high temperature a few promising-looking drafts per step
        otherwise kept every sequence drafting, for fewer tokens than the drafting cost (docs/notebook, bench
        spec at 919e14e). Drafting's time is this thread's CPU time, not the wall clock's: where workers share
        cores, a worker descheduled while it drafted would read the wait as drafting's cost and pause drafting,
        which its probes, up to 64 steps apart, may not resume within a call (docs/design.md, section 7).
        `plain_cost` and `kept_cost` are measured seconds (the cost model's, corrected online): a model measured
        on a quieter machine than the steps run on (a pool's first worker measures alone, the others start
        with its model; their steps then took up to 2.9x its seconds) priced the saving below what the steps
        saved, and more steps counted as not paying (docs/design.md, section 7)."""
        gain = sum(sum(r[:k]) for r, k in zip(ranked, keep))
        saved = (len(ranked) + gain) * plain_cost / len(ranked) - kept_cost if any(keep) else 0.0
        return saved > time.thread_time() - cpu0

    @staticmethod
    def _count_rounds(specs: list[SeqSpec], keep: list[int], skipped: list[bool]) -> None:
        """A sequence loses a round when others' drafts won it, or when it sat this one out. A step that
        drafts nothing at all is the step-level pause's business (`drafting_paused`): counting it here too
        would compound the two schedules until no probe ever drafted again."""
        drafting = any(keep)
        for s, n, skip in zip(specs, keep, skipped):
            s.idle = 0 if n else s.idle + 1 if drafting or skip else s.idle

    def _count_draft_time(self, elapsed: float, specs: list[SeqSpec], skipped: list[bool]) -> None:
        """The step's drafting time, for the engine and, split evenly, for the sequences that drafted."""
        self.stats.draft_s += elapsed
        drafted = [s for s, skip in zip(specs, skipped) if not skip]
        for s in drafted:
            s.stats.draft_s += elapsed / len(drafted)

    def edge_calibration(self, cls: int | None = None) -> list[float]:
        """The calibrated continuation factors by depth (`EdgeCalibration.factors`)."""
        return self.calibration.factors(cls)

    def observe_step(self, seconds: float) -> None:
        """The measured time of the step `plan` planned: updates the measured/predicted ratio."""
        if self._pending is None or not self.correct_cost:
            return
        bucket, drafting, predicted, drafting_s = self._pending
        key = (bucket, drafting)
        if self.cost.padded_rows:  # the drafting itself is priced apart: `_pays`, the pause
            self._host[key] = budget.update_host(self._host.get(key), seconds - drafting_s - predicted)
        else:
            self._ratio[key] = 0.9 * self._ratio.get(key, 1.0) + 0.1 * (seconds / predicted)
        self._pending = None

    def record(self, spec: SeqSpec, draft: Draft, accepted_nodes: list[int], kept: int | None = None) -> None:
        """Bookkeeping after verification: stats, calibration and the next draft length. `kept`: how many
        tokens the sequence appended (None = all it verified). The statistics count only accepted tokens the
        output kept: past an EOS or a stop string the output drops them (they counted before). The
        calibration and the length rule still learn from every acceptance: they model the verifier."""
        if not draft.tokens:
            return
        n_acc = len(accepted_nodes)
        n_kept = n_acc if kept is None else min(n_acc, kept)  # the bonus token, if kept, comes after them
        self.stats.add(draft, n_kept)
        spec.stats.add(draft, n_kept)
        self.calibration.update(draft, accepted_nodes)
        spec.length = self.rule.next(spec.length, max(draft.depths()), n_acc)
