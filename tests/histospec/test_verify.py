"""The acceptance walk on the device (`engine.device_verification`, a GPU's way: every node drawn in one call,
one wait per step) against the host walk of `histospec.verify` with the engine's keyed draws."""

import random

import numpy as np
import pytest
import torch

from rhymerl.engine.backends.op_trace import OpTrace
from rhymerl.engine.device_verification import verify_on_device, walk
from rhymerl.engine.sampler import draw_keys, sample_tensors
from rhymerl.engine.sampling_params import SamplingParams, draw_key, draw_prefix, request_key
from rhymerl.histospec.drafter import Draft
from helpers import host_walk

VOCAB = 5  # few tokens and peaked logits: draws often match a draft's tokens, so walks go deep


def random_draft(rng: random.Random) -> Draft:
    """A tree of 0-12 nodes in topological order, each node's children with distinct tokens."""
    tokens, parents, used = [], [], set()
    for _ in range(rng.randrange(13)):
        p, t = rng.randrange(-1, len(tokens)), rng.randrange(VOCAB)
        if (p, t) not in used:
            used.add((p, t))
            tokens.append(t)
            parents.append(p)
    return Draft(tokens=tokens, parents=parents)


def test_draw_keys_are_draw_key_bit_for_bit():
    rng = random.Random(1)
    seeds, reqs, positions = ([rng.randrange(1 << 63) for _ in range(50)] for _ in range(3))
    prefixes = np.array([draw_prefix(s, r) for s, r in zip(seeds, reqs)])
    keys = draw_keys(prefixes, np.array([p % 4096 for p in positions]))
    assert keys.dtype == np.int64
    assert keys.tolist() == [draw_key(s, r, p % 4096) for s, r, p in zip(seeds, reqs, positions)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3),
                                    SamplingParams(temperature=0.6, top_k=3, top_p=0.9, seed=4)])
def test_the_device_walk_gives_the_host_walks_result(params):
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    accepted = 0
    for trial in range(40):
        drafts = [random_draft(rng) for _ in range(rng.randrange(1, 7))]
        counts = [1 + len(d.tokens) for d in drafts]
        starts = [sum(counts[:i]) for i in range(len(drafts))]
        logits = torch.randn(sum(counts), VOCAB, generator=gen) * 3
        keys = [request_key(f"r{trial}-{i}") for i in range(len(drafts))]
        offsets = [rng.randrange(50) for _ in drafts]
        walked = host_walk(drafts, logits, starts, keys, offsets, params)
        on_device, wait_s = verify_on_device(drafts, logits, starts, [draw_prefix(params.seed, k) for k in keys],
                                             offsets, params)
        assert wait_s >= 0
        assert on_device == walked
        accepted += sum(len(v.path) for v in walked)
    assert accepted > 20  # the trees were walked, not just their roots drawn


def test_a_fork_in_a_draft_is_refused_not_guessed():
    """Two children of the root with one token: the host walk takes one of them, the device walk would reach
    both; it returns None and the engine walks on the host."""
    logits = torch.full((3, VOCAB), -10.0)
    logits[:, 2] = 10.0  # every draw is token 2
    fork = Draft(tokens=[2, 2], parents=[-1, -1])
    assert verify_on_device([fork], logits, [0], [draw_prefix(0, 1)], [0], SamplingParams(temperature=0))[0] is None


# ops that read a device value on the host (a synchronisation, which a CUDA graph forbids) or whose output
# shape depends on the data (tests/engine/backends/test_static_step.py checks the forward for the same)
HOST_READS = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "tolist", "repeat_interleave")


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3),
                                    SamplingParams(temperature=0.6, top_k=3, top_p=0.9, seed=4)])
def test_the_keyed_draws_and_the_walk_are_device_work_alone(params):
    """What lets the draws and the walk sit in a CUDA graph, checked on the CPU: keys, draws and the walk over
    rows of any content run the same ops on the same shapes, none reading a value back to the host; and a
    walk of more rounds than the trees are deep (a fixed shape's bound) reaches the same rows."""
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    traces = []
    for trial in range(2):
        drafts = [random_draft(rng) for _ in range(4)]
        counts = [1 + len(d.tokens) for d in drafts]
        first = [sum(counts[:i]) for i in range(len(drafts))]
        parent = torch.tensor([f + 1 + p if p >= 0 else f  # a root's parent: itself
                               for f, d in zip(first, drafts) for p in [-1] + d.parents])
        token = torch.tensor([t for d in drafts for t in [-1] + d.tokens])
        padded = 64 - len(parent)  # one fixed shape for both trials: padding rows are roots of their own
        parent = torch.cat((parent, torch.arange(len(parent), 64)))
        token = torch.cat((token, torch.full((padded,), -1)))
        logits = torch.randn(64, VOCAB, generator=gen) * 3
        prefixes = torch.randint(-(1 << 62), 1 << 62, (64,), generator=gen)
        positions = torch.randint(0, 100, (64,), generator=gen)
        keys = torch.from_numpy(draw_keys(prefixes.numpy(), positions.numpy()))  # on the host, with the inputs
        with OpTrace() as trace:
            drawn, _ = sample_tensors(logits, params, keys)
            reached = walk(drawn, parent, token, 12)
        traces.append([(op, shapes) for op, shapes, _ in trace.ops])
        depth = max([max(d.depths(), default=0) for d in drafts])
        assert torch.equal(reached, walk(drawn, parent, token, depth))
    assert traces[0] == traces[1]
    assert not [op for op, _ in traces[0] if any(name in op for name in HOST_READS)]
