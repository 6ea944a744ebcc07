"""The cached forward modes (prefill chunk, decode, draft tree, commit) against dense recomputation."""

import pytest
import torch

from rhymerl.engine.backends import CpuBackend, EagerBackend, native
from rhymerl.engine.backends.cpu_attention import TREE_STEP
from rhymerl.engine.backends.eager import SMALL_STEP
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.model_runner import ModelRunner, SlotInput
from tiny_models import VOCAB, random_prompts, tiny_decoder


@pytest.fixture(params=["fused", "eager"], autouse=True)
def forward_kind(request):
    """Every test runs both forwards: the fused CPU kernels (where they build) and the eager one."""
    if request.param == "fused" and native.ops() is None:
        pytest.skip("fused CPU kernels unavailable here (no C++ compiler?)")
    return request.param


@pytest.fixture
def make_runner(forward_kind):
    def make(arch="llama", slots=4, max_len=64, scratch=16):
        model = tiny_decoder(arch)
        c = model.cfg
        cache = KVCache(c.num_layers, slots, max_len, c.num_kv_heads, c.head_dim, torch.float32, "cpu", scratch)
        runner = ModelRunner(model, cache, fused=forward_kind == "fused")
        assert (runner.ops is not None) == (forward_kind == "fused")
        assert isinstance(runner.backend, CpuBackend if forward_kind == "fused" else EagerBackend)
        return model, runner
    return make


def dense_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama-d64"])
def test_mixed_prefill_and_decode_in_one_forward(make_runner, arch):
    model, runner = make_runner(arch)
    a, b, c = random_prompts(3, seed=5)
    runner.run([SlotInput(0, 0, a[:-1]), SlotInput(2, 0, b[:-1])])  # slots 0 and 2 hold a, b minus one
    # One step: slot 0 and 2 decode one token each, slot 1 prefills c in full.
    logits = runner.run([SlotInput(0, len(a) - 1, a[-1:]), SlotInput(1, 0, c), SlotInput(2, len(b) - 1, b[-1:])])
    assert logits.shape == (2 + len(c), VOCAB)
    torch.testing.assert_close(logits[0], dense_logits(model, a)[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1 : 1 + len(c)], dense_logits(model, c), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[-1], dense_logits(model, b)[-1], atol=1e-5, rtol=1e-5)


# A draft tree hanging from the last real token x (index 0):
#        0(x)
#       /    \
#      1      2
#     / \      \
#    3   4      5
#    |
#    6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]
PATHS = [[0, 1, 3, 6], [0, 1, 4], [0, 2, 5]]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-d64"])  # d64: the fused tree attention
def test_draft_tree_matches_each_path_run_alone(make_runner, arch):
    model, runner = make_runner(arch)
    prompt = random_prompts(1, lo=6, hi=6, seed=7)[0]
    tree = [11, 22, 33, 44, 55, 66, 77]
    runner.run([SlotInput(1, 0, prompt[:-1])])
    tree[0] = prompt[-1]
    other = random_prompts(1, seed=8)[0]  # a decode row in the same step must not disturb the tree
    runner.run([SlotInput(3, 0, other[:-1])])
    logits = runner.run([SlotInput(1, len(prompt) - 1, tree, PARENTS), SlotInput(3, len(other) - 1, other[-1:])])
    for path in PATHS:
        ref = dense_logits(model, prompt[:-1] + [tree[i] for i in path])[len(prompt) - 1 :]
        torch.testing.assert_close(logits[path], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[-1], dense_logits(model, other)[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "llama-d64"])
def test_commit_keeps_the_chosen_path(make_runner, arch):
    model, runner = make_runner(arch)
    prompt = random_prompts(1, lo=5, hi=5, seed=9)[0]
    tree = [prompt[-1], 21, 31, 41, 51, 61, 71]
    base = len(prompt) - 1
    runner.run([SlotInput(0, 0, prompt[:-1])])
    runner.run([SlotInput(0, base, tree, PARENTS)])
    path = [0, 2, 5]
    runner.commit(0, base, path)
    accepted = prompt[:-1] + [tree[i] for i in path]
    nxt = 9  # continue decoding after the committed path: must equal a plain run of the same tokens
    logits = runner.run([SlotInput(0, len(accepted), [nxt])])
    torch.testing.assert_close(logits[0], dense_logits(model, accepted + [nxt])[-1], atol=1e-5, rtol=1e-5)


def test_logits_from_and_bad_tree(make_runner):
    model, runner = make_runner()
    prompt = random_prompts(1, lo=8, hi=8, seed=10)[0]
    logits = runner.run([SlotInput(0, 0, prompt, logits_from=len(prompt) - 1)])
    assert logits.shape == (1, VOCAB)
    torch.testing.assert_close(logits[0], dense_logits(model, prompt)[-1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="topological"):
        runner.run([SlotInput(1, 0, [1, 2, 3], [-1, 2, 0])])
    with pytest.raises(ValueError, match="capacity"):
        runner.run([SlotInput(2, 70, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])])


@pytest.mark.parametrize("arch", ["llama", "llama-d64"])  # heads of 64: the fused decode attention
def test_stale_cache_contents_never_leak(make_runner, arch):
    """Whatever earlier sequences left in the cache (here: large garbage) is invisible: only the slot's
    committed prefix and the step's own tokens are attended to, idle slots inside the attended range
    included (they are padding rows)."""
    model, runner = make_runner(arch, slots=6)
    runner.cache.kv.normal_(0, 1e3)
    a, b, c = random_prompts(3, seed=11)
    runner.run([SlotInput(0, 0, a[:-1]), SlotInput(3, 0, b[:-1]), SlotInput(5, 0, c[:-1])])
    # Slots 1, 2 and 4 are idle padding rows inside the range [0, 6) of this decode step.
    logits = runner.run([SlotInput(0, len(a) - 1, a[-1:]), SlotInput(3, len(b) - 1, b[-1:]),
                         SlotInput(5, len(c) - 1, c[-1:])])
    for row, p in zip(logits, (a, b, c)):
        torch.testing.assert_close(row, dense_logits(model, p)[-1], atol=1e-5, rtol=1e-5)
    # Sparse slots (0 and 5 only): their rows are gathered instead.
    logits = runner.run([SlotInput(0, len(a), [7]), SlotInput(5, len(c), [9])])
    torch.testing.assert_close(logits[0], dense_logits(model, a + [7])[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], dense_logits(model, c + [9])[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "llama-d64"])
def test_every_kind_of_step_in_one_forward(make_runner, arch):
    """A decode row and a draft tree (one attention group, padded to the tree's size, their slots sparse
    in the range so their rows are gathered) beside a prefill longer than SMALL_STEP (a group of its
    own), each against dense recomputation."""
    model, runner = make_runner(arch, slots=8)
    a, b = random_prompts(2, seed=12)
    long_prompt = random_prompts(1, lo=SMALL_STEP + 5, hi=SMALL_STEP + 5, seed=13)[0]
    runner.run([SlotInput(0, 0, a[:-1]), SlotInput(7, 0, b[:-1])])
    tree = [b[-1], 11, 22, 33, 44, 55, 66]
    logits = runner.run([SlotInput(0, len(a) - 1, a[-1:]), SlotInput(3, 0, long_prompt),
                         SlotInput(7, len(b) - 1, tree, PARENTS)])
    torch.testing.assert_close(logits[0], dense_logits(model, a)[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1 : 1 + len(long_prompt)], dense_logits(model, long_prompt), atol=1e-5,
                               rtol=1e-5)
    tree_logits = logits[1 + len(long_prompt) :]
    for path in PATHS:
        ref = dense_logits(model, b[:-1] + [tree[i] for i in path])[len(b) - 1 :]
        torch.testing.assert_close(tree_logits[path], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "llama-d64"])
def test_decode_rows_beside_a_long_prefill(make_runner, arch):
    """Decode rows whose attention group is not the whole step (a prefill longer than TREE_STEP is its
    own group, whichever attention serves the small steps), so their queries are picked out of the
    step's tokens: at heads of 64, the fused tree attention's Python-side call."""
    model, runner = make_runner(arch, slots=8, max_len=128)
    a, b = random_prompts(2, seed=14)
    long_prompt = random_prompts(1, lo=TREE_STEP + 6, hi=TREE_STEP + 6, seed=15)[0]
    runner.run([SlotInput(1, 0, a[:-1]), SlotInput(6, 0, b[:-1])])
    logits = runner.run([SlotInput(1, len(a) - 1, a[-1:]), SlotInput(4, 0, long_prompt),
                         SlotInput(6, len(b) - 1, b[-1:])])
    torch.testing.assert_close(logits[0], dense_logits(model, a)[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1:-1], dense_logits(model, long_prompt), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[-1], dense_logits(model, b)[-1], atol=1e-5, rtol=1e-5)
