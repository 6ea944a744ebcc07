"""Draws and the acceptance walk inside the fixed-shape step (`StaticStep.draw`, `CudaBackend.forward_drawn`),
run eagerly on the CPU ("static" mode): the same tokens and log-probs, bit for bit, as the draws made after
the step (`device_verification.verify_on_device`), the host walk's result on random trees, and a step whose
ops a CUDA graph can hold."""

import random

import pytest
import torch

from rhymerl.engine.backends import CudaBackend
from rhymerl.engine.backends.op_trace import OpTrace
from rhymerl.engine.backends.static_step import StaticStep
from rhymerl.engine.device_verification import StepDraws, read_drawn, walk, walk_trees
from rhymerl.engine.engine import Engine
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.model_runner import SlotInput, _ancestors
from rhymerl.engine.sampling_params import SamplingParams, draw_prefix, request_key
from rhymerl.histospec.drafter import Draft
from helpers import history_of, host_walk, peaky, speculator
from tiny_models import random_prompts, tiny_decoder

PARAMS = [SamplingParams(temperature=0), SamplingParams(temperature=0.6, seed=4),
          SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.8, top_k=3, top_p=0.9, seed=5)]


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
def test_in_step_draws_give_the_tokens_of_the_draws_after_the_step(temperature):
    """Plain and HistoSpec engines on the static steps (fp32): drawing inside the step gives the very tokens
    and log-probs (bit for bit) of the logits-then-draws path it replaces, and every step drew inside."""
    model = peaky(tiny_decoder("llama-d64"))
    prompts = random_prompts(3, lo=9, hi=12, seed=11)
    params = SamplingParams(temperature=temperature, max_tokens=16, seed=3)
    history = history_of(model, prompts, params)
    batch = [p for p in prompts for _ in range(2)]  # siblings: prefix copiers, admission steps of several parts
    ids = [f"p{i}-g{g}" for i in range(3) for g in range(2)]
    for spec in ("off", "histospec"):
        outs, drawn_steps = [], []
        for in_step in (True, False):
            e = Engine(model, num_slots=4, max_model_len=64, eos_token_ids=[], speculator=speculator(spec, history))
            e.runner.backend = backend = CudaBackend(model, e.cache, "static")
            real = backend.forward_drawn
            backend.forward_drawn = lambda *a: drawn_steps.append(in_step) or (real(*a) if in_step else None)
            outs.append(e.generate(batch, params, request_ids=ids))
            if spec == "histospec":
                assert e.speculator.stats.accepted > 0
        assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
        assert [o.logprobs for o in outs[0]] == [o.logprobs for o in outs[1]]  # bit for bit
        assert drawn_steps.count(True) == drawn_steps.count(False) > 0


def random_tree(rng: random.Random, vocab: int, most: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of up to `most` draft nodes in topological order, each node's children with
    distinct tokens (what `Drafter` grows)."""
    tokens, parents, used = [], [], set()
    for _ in range(rng.randrange(most + 1)):
        p, t = rng.randrange(-1, len(tokens)), rng.randrange(vocab)
        if (p, t) not in used:
            used.add((p, t))
            tokens.append(t)
            parents.append(p)
    return tokens, parents


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "t0.6", "t1", "topk-topp"])
def test_the_in_step_walk_is_the_host_walk_on_random_trees(params):
    """Random draft trees in a by-slot bucket (8 rows x 8 tokens: walk of 7 rounds) over random peaked logits
    of 5 columns: the step's draws and walk (`StaticStep.draw`, read by `read_drawn`) give `histospec.verify`'s
    host walk with the engine's keyed draws."""
    model = tiny_decoder("llama")
    c = model.cfg
    cache = KVCache(c.num_layers, 8, 96, c.num_kv_heads, c.head_dim, torch.float32, "cpu", 7)
    step = StaticStep(model, cache, False, 8, 8, 104)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    accepted = 0
    for trial in range(30):
        slots = sorted(rng.sample(range(8), rng.randrange(1, 9)))
        drafts = [Draft(*random_tree(rng, 5, 7)) for _ in slots]
        inputs = [SlotInput(s, rng.randrange(60), [rng.randrange(5)] + d.tokens,
                            [-1] + [0 if p < 0 else p + 1 for p in d.parents] if d.tokens else None)
                  for s, d in zip(slots, drafts)]
        keys = [request_key(f"r{trial}-{s}") for s in slots]
        offsets = [rng.randrange(50) for _ in slots]
        draws = StepDraws([draw_prefix(params.seed, k) for k in keys], offsets, params)
        index = step.load(inputs, [_ancestors(x.parents, len(x.tokens)) for x in inputs], draws)
        logits = torch.randn(8 * 8, 5, generator=gen) * 3  # padding rows too: drawn, never read
        verified, wait_s = read_drawn(drafts, step.draw(logits, params), index)
        counts = [1 + len(d.tokens) for d in drafts]
        starts = [sum(counts[:i]) for i in range(len(drafts))]
        assert verified == host_walk(drafts, logits[torch.from_numpy(index)], starts, keys, offsets, params)
        accepted += sum(len(v.path) for v in verified)
    assert accepted > 15  # the trees were walked, not just their roots drawn


def test_the_doubling_walk_reaches_what_one_level_a_round_reaches():
    """`walk` by pointer doubling (ceil(log2(levels)) rounds) against the plain one-level-a-round walk, on
    random forests up to 31 deep with 2 tokens (long matching paths), at the exact depth and beyond it."""
    gen = torch.Generator().manual_seed(7)
    for trial in range(200):
        n = int(torch.randint(1, 64, (1,), generator=gen))
        parent = torch.tensor([i if i == 0 or bool(torch.rand(1, generator=gen) < 0.1)
                               else int(torch.randint(max(0, i - 3), i, (1,), generator=gen)) for i in range(n)])
        drawn, token = (torch.randint(0, 2, (n,), generator=gen) for _ in range(2))
        is_root = parent == torch.arange(n)
        depth = torch.zeros(n, dtype=torch.long)
        for i in range(n):
            depth[i] = 0 if is_root[i] else depth[parent[i]] + 1
        match, reached = drawn.gather(0, parent) == token, is_root
        for _ in range(int(depth.max())):
            reached = is_root | (reached.gather(0, parent) & match)
        for levels in (int(depth.max()), int(depth.max()) + 5):
            assert torch.equal(walk(drawn, parent, token, levels), reached), (trial, levels)


def test_the_walk_over_ancestor_matrices_reaches_what_the_doubling_walk_reaches():
    """`walk_trees` (a fixed-shape step's: four ops over the attention mask's ancestor matrices, roots pointing
    at a sentinel -1) against `walk` on random forests of B trees of T rows, some rows roots of their own
    (padding, a chain's rows before its first drawn one), 2 tokens (long matching paths)."""
    gen = torch.Generator().manual_seed(5)
    for trial in range(100):
        b, t = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 12, (1,), generator=gen))
        r = b * t
        local = [[-1] + [-1 if bool(torch.rand(1, generator=gen) < 0.15) else int(torch.randint(0, i, (1,), generator=gen))
                         for i in range(1, t)] for _ in range(b)]
        ancestors = torch.zeros(b, t, t, dtype=torch.bool)
        for k, tree in enumerate(local):
            for i, p in enumerate(tree):
                ancestors[k, i] = ancestors[k, p] if p >= 0 else False
                ancestors[k, i, i] = True
        parent = torch.tensor([k * t + (p if p >= 0 else i) for k, tree in enumerate(local) for i, p in enumerate(tree)])
        is_root = parent == torch.arange(r)
        token = torch.randint(0, 2, (r,), generator=gen).masked_fill_(is_root, -1)
        drawn = torch.randint(0, 2, (r,), generator=gen)
        expected = walk(drawn, parent, token, t)
        got = walk_trees(torch.cat((drawn, torch.tensor([-1]))), parent.masked_fill(is_root, r), token, ancestors)
        assert torch.equal(got, expected), trial


# Computing ops (on a GPU, kernels) of `StaticStep.draw`, 32 rows of smollm2's vocabulary (49152: whole blocks
# of 256) or of 1000 (a short last block): keyed draws at temperature 1 and greedy, one token a row (T = 1, no
# walk) and trees of 8 tokens (the walk). Before (keys hashed in the step, a uniform in five ops, the block's
# columns gathered in seven, the walk by pointer doubling, three ops to stack the result): 86, 6, 100, 20; 88
# at T = 1 in bf16 (its logits copied to fp32 first; now read as they are). Greedy in bf16: one more (its
# log_softmax reads a copy in fp32, as before).
DRAW_LAUNCHES = {(1, "t1"): 56, (1, "greedy"): 4, (8, "t1"): 60, (8, "greedy"): 8, (1, "t1-short-block"): 61}


@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_draws_and_the_walk_launch_so_many_kernels(tokens, dtype):
    model = tiny_decoder("llama-d64")
    c = model.cfg
    cache = KVCache(c.num_layers, 32, 96, c.num_kv_heads, c.head_dim, dtype, "cpu", 8)
    step = StaticStep(model, cache, False, 32, tokens, 64)
    step.load([], [])
    cases = [("t1", SamplingParams(), 49152), ("greedy", SamplingParams(temperature=0), 49152)]
    for name, params, vocab in cases + ([("t1-short-block", SamplingParams(), 1000)] if tokens == 1 else []):
        logits = torch.randn(32 * tokens, vocab).to(dtype)
        with torch.inference_mode():
            step.draw(logits, params)  # a warm-up, as before a capture: the sampler makes its constants once
            with OpTrace() as trace:
                step.draw(logits, params)
        bf16_copy = name == "greedy" and dtype == torch.bfloat16
        assert trace.launches == DRAW_LAUNCHES[tokens, name] + bf16_copy, name


# ops that read a device value on the host or whose output shape depends on the data (a capture forbids both)
HOST_READS = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "tolist", "repeat_interleave")


def traced_step(model, cache, inputs, params, draws: bool) -> OpTrace:
    """The op trace of one by-slot step of `inputs`, the forward alone or with its draws and walk."""
    shape = CudaBackend(model, cache, "static").shapes.of(inputs)
    step = StaticStep(model, cache, *shape)
    prefixes = [draw_prefix(params.seed, x.slot) for x in inputs]
    step.load(inputs, [_ancestors(x.parents, len(x.tokens)) for x in inputs],
              StepDraws(prefixes, [x.base for x in inputs], params))
    with torch.inference_mode():  # a warm-up, as before a capture: the sampler makes its constants once
        step.draw(step.run(), params)
    with torch.inference_mode(), OpTrace() as trace:
        logits = step.run()
        if draws:
            step.draw(logits, params)
    return trace


def test_a_drawing_step_runs_the_same_ops_whatever_it_holds_and_counts_its_kernels():
    """Two verification steps of one bucket with other trees, bases and temperatures: the same ops on the same
    shapes, none reading data back to the host (what a graph of forward + draws + walk needs). The draws
    and the walk add kernels to the step (counted in `launches`: what `bench engine` reports)."""
    model = tiny_decoder("llama-d64")
    c = model.cfg
    cache = KVCache(c.num_layers, 8, 96, c.num_kv_heads, c.head_dim, torch.float32, "cpu", 8)
    traces = []
    for base, temperature in ((5, 0.6), (31, 1.0)):
        inputs = [SlotInput(0, base, [1, 3, 4, 5], [-1, 0, 0, 1]), SlotInput(2, base + 7, [2, 6], [-1, 0]),
                  SlotInput(5, base + 1, [7])]
        traces.append(traced_step(model, cache, inputs, SamplingParams(temperature=temperature), True))
    assert [(op, shapes) for op, shapes, _ in traces[0].ops] == [(op, shapes) for op, shapes, _ in traces[1].ops]
    assert not [op for op, _, _ in traces[0].ops if any(name in op for name in HOST_READS)]
    forward = traced_step(model, cache, inputs, SamplingParams(), False)
    assert traces[0].launches > forward.launches
