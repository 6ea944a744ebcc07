"""How much to draft (docs/design.md, section 7; docs/histospec.md): which draft nodes a step verifies, when
drafting pauses, and the optional per-sequence draft-length rules.

A node's value is the number of tokens it is expected to add (its calibrated path probability); a step's
cost comes from the measured `CostModel`. The planners below keep the nodes that maximise expected committed
tokens per second against plain decoding's rate, and keep every draft a rooted subtree.
"""

from __future__ import annotations

from rhymerl.histospec.drafter import Draft

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


def is_probe_step(idle: int) -> bool:
    """Whether a step after `idle` consecutive zero-budget steps drafts (see PROBE_EVERY)."""
    if idle < PROBE_EVERY:
        return True
    return idle & (idle - 1) == 0 if idle < PROBE_MAX else idle % PROBE_MAX == 0


# ---- draft length per sequence (rollout.draft_rule) ---------------------------------------------
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
DRAFT_RULES = tuple(LENGTH_RULES)  # rollout.draft_rule's choices (the config reads them here)


def length_rule(name: str, max_draft_tokens: int):
    """The per-sequence draft-length rule called `name` (a key of LENGTH_RULES)."""
    if name not in LENGTH_RULES:
        raise ValueError(f"draft_rule must be one of {DRAFT_RULES}, got {name!r}")
    return LENGTH_RULES[name](max_draft_tokens) if name == "cost" else LENGTH_RULES[name]()


# ---- the time a GPU step spends outside its priced step ------------------------------------------------
# On a GPU the cost model prices a step at its bucket's measured step (`CostModel.step`; `ModelRunner.measure_cost`
# times the forward with the draws and walk in it, the runner's packing and the host's reading of the result);
# the rest of the engine's step (scheduling, the drafts' trees, the commits, the sequences' bookkeeping: of
# the ~3 ms a 10 ms plain step of a 135M model spent outside its forward on an H100, ~6 ms more when it
# drafted, issue 34, what the runner's part does not hold) is a fixed cost per step, which a
# measured/predicted ratio would scale with the forward, pricing a shallow draft far below its cost. The
# speculator measures it per (rows bucket, drafting), step by step.
HOST_DECAY = 0.9  # per measured step: recent steps count most


def host_seconds(host: dict[tuple[int, bool], float], bucket: int, drafting: bool) -> float:
    """A step's time outside its priced step (`host`: measured per (bucket, drafting)). Where
    this bucket's was not measured yet, the stated prior: the nearest measured bucket's, and for a drafting
    step with none measured, what a plain step's is (the same fixed cost both ways, so the measured steps
    decide until a drafting step is timed: the probe steps draft, so one will be); else 0. Never
    below 0: a step is not priced under its bucket's measured step."""
    for flag in (drafting, False):
        near = [(abs(b - bucket), b) for b, d in host if d == flag]
        if near:
            return max(host[(min(near)[1], flag)], 0.0)
    return 0.0


def update_host(old: float | None, seconds: float) -> float:
    """`old` (None: none yet) moved towards one step's measured time outside its priced step."""
    return seconds if old is None else HOST_DECAY * old + (1 - HOST_DECAY) * seconds


# ---- which nodes a step verifies ----------------------------------------------------------------
def uniform_cap(ranked: list[list[float]], cost, plain_rate: float) -> tuple[list[int], int]:
    """The cap c on every draft (each sequence's c most valuable nodes) that maximises committed tokens per
    second, against plain decoding's rate. ranked: per draft, its node values (expected accepted tokens)
    in decreasing order; cost(n, longest): the step's predicted time with n draft tokens, the longest draft
    `longest` of them (a GPU pads every row to the longest: `CostModel.step`). Returns (the nodes kept per
    draft, the draft tokens the step was costed at)."""
    gains = [_prefix_sums(v) for v in ranked]
    n_dec = len(ranked)
    best_c, best_rate = 0, plain_rate
    longest = max(map(len, ranked), default=0)
    for c in sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, longest}):
        if c > longest:
            break
        # costed as if every draft had c nodes: pessimistic for short drafts, which keeps marginal
        # drafting (a high temperature, where drafts barely pay) from slowing the drain down
        rate = (n_dec + sum(g[min(c, len(g) - 1)] for g in gains)) / cost(n_dec * c, c)
        if rate > best_rate:
            best_c, best_rate = c, rate
    return [min(best_c, len(v)) for v in ranked], n_dec * best_c


def top_nodes(ranked: list[list[float]], cost, plain_rate: float) -> tuple[list[int], int]:
    """The k most valuable nodes of the whole step, with k maximising committed tokens per second, against
    plain decoding's rate. Each draft keeps a prefix of its ranking (the sort is stable), so a rooted
    subtree. Same arguments and result as `uniform_cap`."""
    flat = sorted(((x, i) for i, v in enumerate(ranked) for x in v), key=lambda t: -t[0])
    gain = _prefix_sums([x for x, _ in flat])
    longest, counts = [0], [0] * len(ranked)  # longest[k]: the longest draft among the first k nodes
    for _, i in flat:
        counts[i] += 1
        longest.append(max(longest[-1], counts[i]))
    best_k, best_rate = 0, plain_rate
    for k in sorted({1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, len(flat)}):
        if k > len(flat):
            break
        rate = (len(ranked) + gain[k]) / cost(k, longest[k])
        if rate > best_rate:
            best_k, best_rate = k, rate
    keep = [0] * len(ranked)
    for _, i in flat[:best_k]:
        keep[i] += 1
    return keep, best_k


def explore(ranked: list[list[float]], keep: list[int], k: int) -> int:
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


def prune(draft: Draft, keep: set[int]) -> Draft:
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
