"""HistoSpec inside the engine: which drafts to verify this step, and what they commit.

Per step: every decoding sequence asks the drafter for a token tree (history -> siblings -> self), as
large as its adaptive draft length allows; a cost model of the forward pass, measured at start-up, then
keeps only the draft tokens whose expected acceptances buy more than the extra forward time they cost
(`propose`: the step's best nodes while requests wait, the same cap for every tree in the drain); the
engine runs one forward over all slots; `verify` walks each tree with the policy's own draws (DESIGN 3.4).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rhymerl.spec.drafter import Draft, Drafter
from rhymerl.spec.history import HistoryStore
from rhymerl.spec.suffix_index import SuffixIndex

SIBLING_PROMPT_TOKENS = 8  # the end of the prompt goes in front of each sibling, so first tokens can match
# Once drafts stopped paying (PROBE_EVERY steps in a row that saved less than drafting took), drafting is skipped
# except on probe steps, which watch whether drafts pay again (the tail, a more predictable prompt): after
# 8, 16, 32 and 64 such steps, then every 64th. The gap grows because every probe that finds nothing costs
# a whole step's drafting, and at a high temperature that is every probe.
PROBE_EVERY = 8
PROBE_MAX = 64
# A probe step while paused verifies up to PROBE_NODES of its most valuable draft nodes whatever the budget
# says, as many as add at most PROBE_SPEND to the step's predicted time: the budget values nodes by the edge
# calibration, which learns only from verified drafts, so without these a few early rejections (two
# single-token drafts were enough) could stop drafting for a whole rollout.
PROBE_NODES = 4
PROBE_SPEND = 0.2
# The drafter matches up to MATCH_WINDOW recent tokens (the example is 7). A longer match tells apart
# sources that agree on the last 7 tokens but not before: two responses caught in similar loops, or a
# history response that shares a phrase but not the sentence. On the T=0.3 tail a 15-token window took
# clearly fewer forwards than 7 (docs/benchmarks.md, fifteenth session); 23 gained nothing more.
MATCH_WINDOW = 15
# Edge calibration is kept apart for drafts from matches shorter than LONG_MATCH tokens and the rest.
LONG_MATCH = 7
MATCH_CLASSES = 2


def is_probe_step(idle: int) -> bool:
    """Whether a step after `idle` consecutive zero-budget steps drafts (see PROBE_EVERY)."""
    if idle < PROBE_EVERY:
        return True
    return idle & (idle - 1) == 0 if idle < PROBE_MAX else idle % PROBE_MAX == 0


# ---- draft length per sequence ------------------------------------------------------------------
class AIMDLength:
    """The RhymeRL paper's rule: start at 2, +2 after a fully accepted draft, back to 2 on a rejection."""

    def __init__(self, start: int = 2, step: int = 2, cap: int = 32):
        self.start, self.step, self.cap = start, step, cap

    def next(self, length: int, drafted: int, accepted: int) -> int:
        if drafted == 0:
            return length
        return min(length + self.step, self.cap) if accepted == drafted else self.start


class DoublingLength:
    """The authors' open-source rule: double after a fully accepted draft, halve on a rejection (2..16)."""

    def __init__(self, lo: int = 2, hi: int = 16):
        self.start, self.lo, self.hi = lo, lo, hi

    def next(self, length: int, drafted: int, accepted: int) -> int:
        if drafted == 0:
            return length
        return min(length * 2, self.hi) if accepted == drafted else max(length // 2, self.lo)


class CostOnlyLength:
    """No per-sequence rule: every sequence offers a full tree and the per-step cost model alone decides
    how much of it to verify (the drafter's calibrated path probabilities say what each node is worth)."""

    def __init__(self, cap: int = 32):
        self.start = cap

    def next(self, length: int, drafted: int, accepted: int) -> int:
        return length


LENGTH_RULES = {"aimd": AIMDLength, "doubling": DoublingLength, "cost": CostOnlyLength}


# ---- cost of a forward pass ---------------------------------------------------------------------
class CostModel:
    """Forward time (seconds) of a step with `seqs` sequences feeding `tokens` tokens in all, from a grid
    measured on this machine: times[i][j] for seqs_grid[i] sequences x per_seq_grid[j] tokens each.
    Bilinear interpolation in (sequences, tokens per sequence), linear extrapolation past the grid, and
    the grid is made non-decreasing first (measurement noise must not make a bigger step look cheaper).
    `measured`: timed on this machine (`Engine.measure_cost_model`), so a Speculator corrects it online
    against the steps it times; a grid written by hand (tests, a fixed model) is taken as is.
    """

    def __init__(self, seqs_grid: list[int], per_seq_grid: list[int], times: list[list[float]],
                 measured: bool = False):
        self.seqs_grid, self.per_seq_grid = list(seqs_grid), list(per_seq_grid)
        self.measured = measured
        rows = [_cummax(r) for r in times]
        cols = [_cummax([rows[i][j] for i in range(len(rows))]) for j in range(len(per_seq_grid))]
        self.times = [[cols[j][i] for j in range(len(per_seq_grid))] for i in range(len(seqs_grid))]

    def __call__(self, tokens: int, seqs: int = 1) -> float:
        per_seq = tokens / max(seqs, 1)
        at_seqs = [_interp(list(zip(self.per_seq_grid, row)), per_seq) for row in self.times]
        return _interp(list(zip(self.seqs_grid, at_seqs)), seqs)

    def as_dict(self) -> dict:
        return {"seqs": self.seqs_grid, "tokens_per_seq": self.per_seq_grid, "seconds": self.times}

    def ceiling(self, seqs: int, max_tokens_per_seq: int) -> tuple[float, int]:
        """The most any drafter could gain over plain decoding with `seqs` sequences, by this grid: a perfect
        drafter, every draft a chain of t-1 tokens the policy accepts whole, commits t tokens per sequence
        per forward of cost(seqs * t), where plain commits 1 per cost(seqs). Returns (the best
        t * cost(seqs) / cost(seqs * t) over t = 1..max_tokens_per_seq, the t that reaches it). The
        forward only: the rest of a step (drafting, sampling) is left out."""
        plain = self(seqs, seqs)
        best = max(range(1, max_tokens_per_seq + 1), key=lambda t: (t * plain / self(seqs * t, seqs), -t))
        return best * plain / self(seqs * best, seqs), best


def _cummax(xs: list[float]) -> list[float]:
    out, m = [], float("-inf")
    for x in xs:
        m = max(m, x)
        out.append(m)
    return out


def _interp(pts: list[tuple[float, float]], x: float) -> float:
    if len(pts) == 1 or x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


# ---- statistics -------------------------------------------------------------------------------
@dataclass
class SpecStats:
    """HistoSpec's work, for the whole engine (`Speculator.stats`) or for one request
    (`RequestOutput.spec`)."""

    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    accepted_by_source: dict = field(default_factory=lambda: {"history": 0, "siblings": 0, "self": 0})
    verify_steps: int = 0  # (sequence, step) pairs that verified a non-empty draft
    # time spent drafting and choosing the budget; for a request, its share: each drafting step's time
    # split evenly over the sequences that drafted in it
    draft_s: float = 0.0

    @property
    def accept_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)

    @property
    def mean_accepted_len(self) -> float:
        """Accepted draft tokens per verified draft."""
        return self.accepted / max(self.verify_steps, 1)

    def add(self, draft: Draft, accepted: int) -> None:
        """Count one verified draft and how many of its tokens the policy accepted."""
        self.drafted += len(draft.tokens)
        self.accepted += accepted
        self.accepted_by_source[draft.source] += accepted
        self.verify_steps += 1


@dataclass
class SiblingGroup:
    """The responses of the sequences sharing a prompt in this batch, as one suffix index (one sequence per
    sibling), plus the tokens committed since the index was last read: the index is only read when
    drafting, so it catches up then (`flush`) and not after every step."""

    index: SuffixIndex = field(default_factory=SuffixIndex)
    unindexed: dict[int, list[int]] = field(default_factory=dict)  # sibling id -> tokens not in `index` yet

    def flush(self) -> None:
        for sid, tokens in self.unindexed.items():
            if tokens:
                self.index.extend(sid, tokens)
                tokens.clear()


@dataclass
class SeqSpec:
    """A sequence's speculation state: its own index, its place among its siblings, its draft length.
    Committed tokens reach `own` (and the group) only when the sequence drafts next: a sequence that
    finishes first, or a step where drafting is paused, never pays for indexing them."""

    own: SuffixIndex
    group: SiblingGroup
    sibling_id: int
    history: SuffixIndex | None
    length: int
    stats: SpecStats = field(default_factory=SpecStats)  # this request's (RequestOutput.spec)
    unindexed: list[int] = field(default_factory=list)  # committed tokens not in `own` yet
    idle: int = 0  # consecutive drafting steps that kept none of this sequence's draft (see Speculator.propose)

    def drafts_now(self) -> bool:
        """After PROBE_EVERY drafting steps in a row that kept nothing of its draft, a sequence drafts only
        every PROBE_EVERY-th time: at a high temperature most sequences match nothing useful, and drafting and
        indexing them at every step cost more than the few tokens the others' drafts gain."""
        return self.idle < PROBE_EVERY or self.idle % PROBE_EVERY == 0

    def flush(self) -> None:
        if self.unindexed:
            self.own.extend(0, self.unindexed)
            self.unindexed.clear()
        self.group.flush()


class Speculator:
    def __init__(self, cost: CostModel, history: HistoryStore | None = None, rule: str = "aimd",
                 max_draft_tokens: int = 32, eos_token_ids=(), max_branches: int = 4, correct_cost: bool = True):
        self.cost = cost
        self.correct_cost = correct_cost  # learn measured/predicted step time online (see observe_step)
        self.history = history
        if rule not in LENGTH_RULES:
            raise ValueError(f"draft_rule must be one of {sorted(LENGTH_RULES)}, got {rule!r}")
        self.rule = LENGTH_RULES[rule](max_draft_tokens) if rule == "cost" else LENGTH_RULES[rule]()
        self.drafter = Drafter(history, max_tokens=max_draft_tokens, max_depth=max_draft_tokens,
                               max_branches=max_branches, max_window=MATCH_WINDOW, eos_token_ids=eos_token_ids)
        self.max_draft_tokens = max_draft_tokens
        self.groups: dict[object, SiblingGroup] = {}  # group key -> the siblings' index
        self.stats = SpecStats()
        # Per-edge calibration, by depth: how often the policy actually continues along a drafted edge out
        # of a node at depth d (0 = the committed token), relative to the drafter's count share for it.
        # The drafter's shares are optimistic (a continuation every history response took has share 1,
        # yet a new response leaves it with some probability at every token), so a node at depth k is worth
        # probs[j] * c_0 * ... * c_{k-1} accepted tokens. By depth because continuing is not memoryless: a
        # response that has followed its history for 10 tokens is copying a span and likely goes on, while
        # the first edge is where most drafts fail; one constant c (c**k) made long chains look worth far
        # less than they are and kept the tail's drafts short.
        # Also by match class (`match_class`): a draft from a match of LONG_MATCH tokens or more is followed
        # more often than one from a 2-token match.
        self._calib_num = [[0.0] * (max_draft_tokens + 1) for _ in range(MATCH_CLASSES)]  # decayed continuations seen
        self._calib_den = [[0.0] * (max_draft_tokens + 1) for _ in range(MATCH_CLASSES)]  # ... and predicted
        # Consecutive steps (per batch-size bucket) whose drafts did not pay for the drafting (a zero budget,
        # or an expected saving below the drafting time): after PROBE_EVERY of them, drafting itself is
        # skipped except on probe steps (`is_probe_step`).
        self._idle: dict[int, int] = {}
        # Measured / predicted step time, for drafting and for plain steps, per batch-size bucket: a real
        # step costs more than the calibration shape (sampling per tree level, mixed groups), and more so
        # when it drafts; the decision compares corrected costs. Updated by `observe_step`.
        self._ratio: dict[tuple[int, bool], float] = {}
        self._pending: tuple | None = None

    def start(self, group_key, prompt_ids: list[int]) -> SeqSpec:
        """Called when a sequence enters a slot."""
        group = self.groups.setdefault(group_key, SiblingGroup())
        own = SuffixIndex()
        own.add(prompt_ids)
        sid = group.index.add(prompt_ids[-SIBLING_PROMPT_TOKENS:])
        history = self.history.index(prompt_ids) if self.history is not None else None
        return SeqSpec(own, group, sid, history, self.rule.start)

    def observe(self, spec: SeqSpec, new_tokens: list[int]) -> None:
        """Called with the tokens a sequence committed this step, for its own and its group's index
        (buffered until the next draft reads them: `SeqSpec.flush`)."""
        spec.unindexed += new_tokens
        spec.group.unindexed.setdefault(spec.sibling_id, []).extend(new_tokens)

    def clear_groups(self) -> None:
        self.groups.clear()

    def drafting_paused(self, seqs: int) -> bool:
        """Whether this step (with `seqs` sequences) skips drafting because drafts stopped paying and it is
        not a probe step (`is_probe_step`). A paused step counts as one more zero-budget step; call
        `propose` only when this says False."""
        bucket = seqs.bit_length()
        idle = self._idle.get(bucket, 0)
        if is_probe_step(idle):
            return False
        self._idle[bucket] = idle + 1
        self._pending = None
        return True

    def propose(self, contexts: list[list[int]], specs: list[SeqSpec], base_tokens: int, seqs: int,
                draining: bool = False, max_depths: list[int] | None = None) -> list[Draft]:
        """Drafts for the decoding sequences (their recent tokens in `contexts`), cut to what maximises
        expected committed tokens per second of forward time; `seqs` sequences feed `base_tokens` tokens
        without drafts; `max_depths`: per sequence, how deep its draft may go (default: no limit beyond the
        drafter's). Nothing (plain decoding) wins whenever drafts do not pay (a full batch, poor
        matches, high temperature). Which nodes compete depends on `draining`:

        - requests still waiting for a slot (False): the step's most valuable nodes, whichever sequences
          they belong to (`_top_nodes`). Any committed token is worth the same then, so throughput is what
          counts, and a copying sequence drafts deep while a poorly matched one drafts nothing.
        - nothing waiting (True, the drain): a cap c on every sequence's draft (`_uniform_cap`). The
          slowest sequence now decides when the rollout ends, and it is typically the poorly matched
          one, which a budget by value alone would starve.

        Measured with `rhymerl bench spec` (docs/benchmarks.md, tenth session)."""
        t0 = time.perf_counter()
        bucket = seqs.bit_length()
        idle = self._idle.get(bucket, 0)
        drafts, skipped = [], []
        for ctx, s, depth in zip(contexts, specs, max_depths or [None] * len(specs)):
            skipped.append(not s.drafts_now())
            if skipped[-1]:
                drafts.append(Draft())
            else:
                s.flush()
                drafts.append(self.drafter.draft(ctx, history=s.history, siblings=s.group.index, own=s.own,
                                                 max_tokens=s.length, max_depth=depth))
        reach = [self.depth_discounts(c) for c in range(MATCH_CLASSES)]
        # Each draft's nodes, most valuable first: a node's calibrated value is never above its parent's
        # (path probability and the depth discount both shrink), and ties go to the lower index (parents
        # come first), so every prefix of this order is a rooted subtree.
        discounts = [reach[self.match_class(d.match_len)] for d in drafts]
        values = [[p * r[k] for p, k in zip(d.probs, d.depths())] for d, r in zip(drafts, discounts)]
        order = [sorted(range(len(v)), key=lambda j: (-v[j], j)) for v in values]
        plain_cost = self.cost(base_tokens, seqs)
        # measured/predicted time of drafting steps relative to plain ones (observe_step)
        scale = self._ratio.get((bucket, True), 1.0) / self._ratio.get((bucket, False), 1.0)
        ranked = [[v[j] for j in o] for v, o in zip(values, order)]

        def step_cost(n: int) -> float:  # predicted time of this step with n draft tokens
            return self.cost(base_tokens + n, seqs) * scale

        plan = _uniform_cap if draining else _top_nodes
        keep, extra = plan(ranked, step_cost, len(contexts) / plain_cost)
        drafting = any(keep)
        # Whether proposing paid, for the step-level pause: the time the kept drafts are expected to save
        # (plain decoding would take longer to commit the same tokens) must exceed the time drafting took.
        # The kept drafts are verified either way (drafting is spent by now), but a step that saves less
        # counts as idle: at a high temperature a few promising-looking drafts per step otherwise kept
        # every sequence drafting, for fewer tokens than the drafting cost (docs/benchmarks.md, 13th session).
        gain = sum(sum(r[:n]) for r, n in zip(ranked, keep))
        saved = (len(contexts) + gain) * plain_cost / len(contexts) - step_cost(extra) if drafting else 0.0
        pays = saved > time.perf_counter() - t0
        if idle >= PROBE_EVERY and not pays:  # a probe that finds drafts still do not pay: explore
            limit = (1 + PROBE_SPEND) * step_cost(extra)  # (PROBE_NODES); the step still counts as idle
            extra += _explore(ranked, keep, sum(step_cost(extra + j) <= limit for j in range(1, PROBE_NODES + 1)))
            drafting = any(keep)
        # A sequence loses a round when others' drafts won it, or when it sat this one out. A step that
        # drafts nothing at all is the step-level pause's business (`drafting_paused`): counting it here
        # too would compound the two schedules until no probe ever drafted again.
        for s, n, skip in zip(specs, keep, skipped):
            s.idle = 0 if n else s.idle + 1 if drafting or skip else s.idle
        self._pending = (bucket, drafting, self.cost(base_tokens + extra, seqs))
        self._idle[bucket] = 0 if pays else idle + 1
        out = [_prune(d, set(o[:n])) for d, o, n in zip(drafts, order, keep)]
        elapsed = time.perf_counter() - t0
        self.stats.draft_s += elapsed
        drafted = [s for s, skip in zip(specs, skipped) if not skip]
        for s in drafted:
            s.stats.draft_s += elapsed / len(drafted)
        return out

    def match_class(self, match_len: int) -> int:
        """0: the draft's match was shorter than LONG_MATCH tokens; 1: it was not. The policy follows the
        second kind clearly more often (docs/benchmarks.md, tenth session, when LONG_MATCH was the whole
        window)."""
        return int(match_len >= LONG_MATCH)

    def edge_calibration(self, match_class: int | None = None) -> list[float]:
        """c_d for d = 0..max_draft_tokens-1: the calibrated continuation factor out of depth d, for drafts
        of `match_class` (None: all drafts pooled). Estimates are shrunk (weight of one observation) so that
        what is rarely verified borrows: pooled, each depth towards the one above it (depth 0 towards
        0.5); a class, each depth towards the pooled estimate of that depth."""
        num = [sum(c) for c in zip(*self._calib_num)]
        den = [sum(c) for c in zip(*self._calib_den)]
        pooled, prior = [], 0.5
        for n, d in zip(num, den):
            prior = min((n + prior) / (d + 1.0), 1.0)
            pooled.append(prior)
        if match_class is not None:
            pooled = [min((n + p) / (d + 1.0), 1.0)
                      for n, d, p in zip(self._calib_num[match_class], self._calib_den[match_class], pooled)]
        return pooled[:-1]

    def depth_discounts(self, match_class: int | None = None) -> list[float]:
        """[max_draft_tokens + 1]: entry k = c_0 * ... * c_{k-1}, the factor on a depth-k node's share."""
        out = [1.0]
        for c in self.edge_calibration(match_class):
            out.append(out[-1] * c)
        return out

    def observe_step(self, seconds: float) -> None:
        """The measured time of the step `propose` planned: updates the measured/predicted ratio."""
        if self._pending is None or not self.correct_cost:
            return
        bucket, drafting, predicted = self._pending
        key = (bucket, drafting)
        self._ratio[key] = 0.9 * self._ratio.get(key, 1.0) + 0.1 * (seconds / predicted)
        self._pending = None

    def record(self, spec: SeqSpec, draft: Draft, accepted_nodes: list[int]) -> None:
        """Bookkeeping after verification: stats, calibration and the next draft length."""
        if not draft.tokens:
            return
        n_acc = len(accepted_nodes)
        self.stats.add(draft, n_acc)
        spec.stats.add(draft, n_acc)
        # Edge calibration: at each node the walk reached, the drafter predicted the walk would continue
        # with probability (sum of the children's shares); it did continue at every node but the last.
        cls = self.match_class(draft.match_len)
        num, den = self._calib_num[cls], self._calib_den[cls]
        for d, (predicted, continued) in enumerate(_edge_events(draft, accepted_nodes)):
            num[d] = 0.99 * num[d] + continued
            den[d] = 0.99 * den[d] + predicted
        depth = max(draft.depths())
        spec.length = self.rule.next(spec.length, depth, n_acc)


def _uniform_cap(ranked: list[list[float]], cost, plain_rate: float) -> tuple[list[int], int]:
    """The cap c on every draft (each sequence's c most valuable nodes) that maximises committed tokens per
    second, against plain decoding's rate. ranked: per draft, its node values (expected accepted tokens)
    in decreasing order; cost(n): the step's predicted time with n draft tokens. Returns (the nodes kept
    per draft, the draft tokens the step was costed at)."""
    gains = [_prefix_sums(v) for v in ranked]
    n_dec = len(ranked)
    best_c, best_rate = 0, plain_rate
    longest = max(map(len, ranked), default=0)
    for c in sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, longest}):
        if c > longest:
            break
        # costed as if every draft had c nodes: pessimistic for short drafts, which keeps marginal
        # drafting (a high temperature, where drafts barely pay) from slowing the drain down
        rate = (n_dec + sum(g[min(c, len(g) - 1)] for g in gains)) / cost(n_dec * c)
        if rate > best_rate:
            best_c, best_rate = c, rate
    return [min(best_c, len(v)) for v in ranked], n_dec * best_c


def _top_nodes(ranked: list[list[float]], cost, plain_rate: float) -> tuple[list[int], int]:
    """The k most valuable nodes of the whole step, with k maximising committed tokens per second, against
    plain decoding's rate. Each draft keeps a prefix of its ranking (the sort is stable), so a rooted
    subtree. Same arguments and result as `_uniform_cap`."""
    flat = sorted(((x, i) for i, v in enumerate(ranked) for x in v), key=lambda t: -t[0])
    gain = _prefix_sums([x for x, _ in flat])
    best_k, best_rate = 0, plain_rate
    for k in sorted({1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, len(flat)}):
        if k > len(flat):
            break
        rate = (len(ranked) + gain[k]) / cost(k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    keep = [0] * len(ranked)
    for _, i in flat[:best_k]:
        keep[i] += 1
    return keep, best_k


def _explore(ranked: list[list[float]], keep: list[int], k: int) -> int:
    """Keep up to k more nodes, the most valuable not kept yet: each draft's next one in its ranking, so every
    draft stays a rooted subtree. Updates `keep` in place; returns how many nodes were added."""
    added = 0
    for _ in range(k):
        open_ = [i for i, (v, n) in enumerate(zip(ranked, keep)) if n < len(v)]
        if not open_:
            break
        best = max(open_, key=lambda i: ranked[i][keep[i]])
        keep[best] += 1
        added += 1
    return added


def _prefix_sums(xs: list[float]) -> list[float]:
    out = [0.0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def _prune(draft: Draft, keep: set[int]) -> Draft:
    """The sub-tree of the kept nodes (closed under parents by construction), re-indexed."""
    if len(keep) == len(draft.tokens):
        return draft
    if not keep:
        return Draft()
    new_index, tokens, parents, probs = {}, [], [], []
    for j, (tok, par, p) in enumerate(zip(draft.tokens, draft.parents, draft.probs)):
        if j in keep:
            new_index[j] = len(tokens)
            tokens.append(tok)
            parents.append(-1 if par < 0 else new_index[par])
            probs.append(p)
    return Draft(tokens, parents, draft.source, draft.match_len, probs)


def _edge_events(draft: Draft, accepted_nodes: list[int]) -> list[tuple[float, int]]:
    """Per depth d of the nodes a verification walk reached (the root at depth 0, then every accepted
    node): (predicted continuations, actual continuations). A reached node with drafted children predicts
    a continuation with the sum of their shares (child path probability / the node's); a leaf predicts
    nothing. The walk continued out of every reached node but the last."""
    share_sum: dict[int, float] = {}
    for j, (par, p) in enumerate(zip(draft.parents, draft.probs)):
        base = 1.0 if par < 0 else draft.probs[par]
        share_sum[par] = share_sum.get(par, 0.0) + (p / base if base > 0 else 0.0)
    reached = [-1] + accepted_nodes
    return [(share_sum.get(v, 0.0), int(d < len(accepted_nodes))) for d, v in enumerate(reached)]


def verify(draft: Draft):
    """The acceptance rule of DESIGN 3.4 for one sequence, as a generator: it yields the draft node it
    needs the policy's draw at (-1 = the sequence's last real token) and is sent the token drawn there,
    with the keyed uniform of that output position, i.e. exactly the draw plain decoding would make.
    Lazy, so the engine only samples the rows of the path actually taken.

    Walk from the root: if the drawn token is a child of the current node, accept it and continue from
    that child; otherwise the drawn token is the last one of this step (the bonus token). A history draft
    is a point mass, so this is standard speculative sampling (accept draft d with probability p(d), else
    sample from p without d) in its point-mass form: the output has exactly the policy's distribution,
    and with keyed draws it is token-identical to plain decoding.

    Returns (via StopIteration.value) the accepted node indices along the path and the tokens to append
    (the accepted ones, then the bonus token).
    """
    children = {(p, t): j for j, (t, p) in enumerate(zip(draft.tokens, draft.parents))}
    path, out, node = [], [], -1
    while True:
        x = yield node
        out.append(x)
        child = children.get((node, x))
        if child is None:
            return path, out
        path.append(child)
        node = child
