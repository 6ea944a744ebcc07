"""HistoSpec's verification on the device: every node of every draft drawn in one sampler call and the
acceptance walk done with tensor ops, so the host waits once per step, for the result (a GPU's way: the host
walk of `histospec.verify` waits for the sampler once per tree level).

The same keyed draws (`sampler.draw_keys` is `draw_key` bit for bit) and the same acceptance rule as the host
walk, its reference: node j of a sequence's tree is reached when its parent is reached and the token drawn at
the parent is j's token. A draft gives each child of a node its own token (`Drafter` grows them from a
token -> child map), so the reached nodes form one path from the root; the tokens drawn along it are the
accepted ones, and the one drawn at its last node is the bonus token. Where a draft breaks that rule the
path is not a chain, and `verify_on_device` says so (None) instead of guessing.

On the CUDA backend's fixed-shape steps (graphs, or "static" mode) the draws and the walk run inside the step
itself (`static_step.StaticStep.draw`, from what `StepDraws` tells it; its walk `walk_trees`, four ops over
the ancestor matrices the step's attention mask holds) and the host reads one small tensor back
(`read_drawn`); `verify_on_device` is the way of a step that cannot (several SamplingParams, a part
that runs eagerly).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from rhymerl.engine.sampler import draw_keys, sample_tensors
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.histospec.drafter import Draft
from rhymerl.histospec.verify import Verified


@dataclass
class StepDraws:
    """What a step's in-step draws need, per input (the engine's SlotInputs, in order): `prefixes`, its
    sequence's `draw_prefix` as a signed int64; `offsets`, the output position its first drawn row draws
    (its output length so far); `params`, every sequence's SamplingParams (one for the whole step)."""

    prefixes: list[int]
    offsets: list[int]
    params: SamplingParams

    @staticmethod
    def of(seqs: list) -> StepDraws | None:
        """The draws of these engine Sequences, or None when they do not share their SamplingParams."""
        params = seqs[0].params
        # `is` first: the requests of one generate() call share one SamplingParams (a dataclass == is ~1 us)
        if any(s.params is not params and s.params != params for s in seqs):
            return None
        return StepDraws([s.draw_prefix for s in seqs], [len(s.output_ids) for s in seqs], params)


def walk(drawn: torch.Tensor, parent: torch.Tensor, token: torch.Tensor, levels: int) -> torch.Tensor:
    """The acceptance rule (`histospec.verify.accept`) over every drawn row at once, in tensor ops alone (no
    read back to the host, shapes fixed by the inputs': what a CUDA graph can hold). drawn, parent, token: [R]
    per row, its drawn token, the row of its parent (a root: itself), its draft token. Returns [R] bool, the
    rows the walk reaches: a root, or a node whose parent is reached and drew this node's token, i.e. every
    node on its path from the root matches. `levels`: at least the deepest node's depth (a fixed shape's
    bound, its tokens less one, will do). By pointer doubling: after round k a row holds the AND over itself
    and its 2^k - 1 nearest ancestors (a root matches and is its own parent), so ceil(log2(levels)) rounds of
    at most three kernels cover every path (7 levels: 3 rounds, where one level a round took 7)."""
    is_root = parent == torch.arange(len(parent), device=parent.device)
    ok = (drawn.gather(0, parent) == token) | is_root  # the parent's draw is this node's token
    up, rounds = parent, max(levels - 1, 0).bit_length()  # ceil(log2(levels)) for levels >= 1
    for k in range(rounds):
        ok = ok & ok.gather(0, up)  # up: each row's 2^k-th ancestor (a root's: itself)
        if k + 1 < rounds:
            up = up.gather(0, up)
    return ok


def walk_trees(drawn: torch.Tensor, parent: torch.Tensor, token: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """`walk` for rows laid out as B trees of T rows each, in four ops whatever the depth (a fixed-shape step's:
    `StaticStep.draw`). drawn [R + 1]: each row's drawn token, then -1; parent [R]: its parent's row, R for a
    root (so a root "matches": its parent drew -1, its own token); token [R]: its draft token, -1 for a root;
    ancestors [B, T, T] bool: row (b, i) has row (b, j) on its path from the root, itself included (the
    attention mask's ancestor matrices). A row is reached when every row on its path matches."""
    ok = drawn.gather(0, parent) == token  # [R]: the parent's draw is this row's token
    b, t, _ = ancestors.shape
    return (ancestors <= ok.view(b, 1, t)).all(-1).view(-1)  # an ancestor implies a match


def verify_on_device(drafts: list[Draft], logits: torch.Tensor, starts: list[int], prefixes: list[int],
                     offsets: list[int], params: SamplingParams) -> tuple[list[Verified] | None, float]:
    """Every sequence's draft verified at once. `logits` [N, V]: sequence i's last committed token at row
    starts[i], its draft node j at starts[i] + 1 + j; `prefixes[i]`: its `draw_prefix` as a signed int64;
    `offsets[i]`: its output length so far (the position of the next token it draws). All with `params`.
    Returns (what `histospec.verify` returns, or None when a draft has two children of one node with the
    same token; the seconds the host waited for the device's results)."""
    counts = np.array([1 + len(d.tokens) for d in drafts])  # rows drawn per sequence: its root and nodes
    first = np.cumsum(counts) - counts  # each sequence's root among the R drawn rows
    seq = np.repeat(np.arange(len(drafts)), counts)  # [R] the sequence of each drawn row
    # [R] per drawn row: the tokens appended before its draw, the drawn row of its parent (a root: itself), its
    # draft token (a root: -1). Python lists: most drafts are empty or small, and numpy per draft costs more.
    depth_l, parent_l, token_l = [], [], []
    for f, d in zip(first.tolist(), drafts):
        depth_l.append(0)
        parent_l.append(f)
        token_l.append(-1)
        if d.tokens:
            depth_l += d.depths()
            parent_l += [f + 1 + p if p >= 0 else f for p in d.parents]
            token_l += d.tokens
    depth, parent, token = np.array(depth_l), np.array(parent_l), np.array(token_l)
    meta = np.stack([np.repeat(starts, counts) + np.arange(counts.sum()) - np.repeat(first, counts),  # logits row
                     draw_keys(np.asarray(prefixes, dtype=np.int64)[seq], np.asarray(offsets)[seq] + depth),
                     parent, token])
    # every row in order (a plain step's): no copy of the rows
    every = meta.shape[1] == len(logits) and bool((meta[0] == np.arange(len(logits))).all())
    meta = torch.from_numpy(meta).to(logits.device)  # [4, R], one copy to the device
    rows, keys, parent_t, token_t = meta
    drawn, logprobs = sample_tensors(logits if every else logits.index_select(0, rows), params, keys)
    levels = int(depth.max())  # 0: no drafts, every row a root, which the walk reaches
    reached = walk(drawn, parent_t, token_t, levels) if levels else torch.ones_like(drawn, dtype=torch.bool)
    t0 = time.perf_counter()
    out = torch.stack((drawn.double(), logprobs.double(), reached.double())).cpu().numpy()  # the one wait
    wait_s = time.perf_counter() - t0
    return _paths(len(drafts), seq, depth, out), wait_s


def read_drawn(drafts: list[Draft], out: torch.Tensor, index: np.ndarray) -> tuple[list[Verified] | None, float]:
    """`verify_on_device`'s result from what a step drew in itself (`ModelRunner.run_drawn`): `out` [3, X] on
    the device (per row: drawn token, its log-prob, reached, as fp32), `index` the columns of each draft's
    rows (its root, then its nodes). Returns (the Verified list, or None for a draft whose path forks; the
    seconds the host waited for the device)."""
    t0 = time.perf_counter()
    host = out.cpu().numpy()  # the one wait of the step
    wait_s = time.perf_counter() - t0
    host = host[:, index]
    if len(index) == len(drafts):  # no drafts (a plain step): one root a sequence
        return [Verified([], [t], [lp]) for t, lp in zip(host[0].astype(np.int64).tolist(), host[1].tolist())], wait_s
    counts = np.array([1 + len(d.tokens) for d in drafts])
    depth = np.array([x for d in drafts for x in [0] + d.depths()])
    return _paths(len(drafts), np.repeat(np.arange(len(drafts)), counts), depth, host), wait_s


def _paths(n: int, seq: np.ndarray, depth: np.ndarray, out: np.ndarray) -> list[Verified] | None:
    """The Verified of `n` sequences from their drawn rows (`seq`, `depth` [R]: each row's sequence and depth;
    `out` [3, R]: drawn token, log-prob, reached), or None when a path forks."""
    drawn_h, logprobs_h, reached_h = out[0].astype(np.int64), out[1], out[2].astype(bool)
    hit = np.nonzero(reached_h)[0]  # in tree order, so each sequence's path in depth order
    per_seq = np.bincount(seq[hit], minlength=n)
    deepest = np.zeros(n, dtype=np.int64)
    np.maximum.at(deepest, seq[hit], depth[hit])
    if (per_seq != deepest + 1).any():  # a path that forks: two children of a node share a token
        return None
    result, hit_l, drawn_l, logprobs_l, a = [], hit.tolist(), drawn_h.tolist(), logprobs_h.tolist(), 0
    for b in np.cumsum(per_seq).tolist():
        path = hit_l[a:b]  # the root's row, then the accepted nodes' rows
        result.append(Verified([r - path[0] - 1 for r in path[1:]], [drawn_l[r] for r in path],
                               [logprobs_l[r] for r in path]))
        a = b
    return result
