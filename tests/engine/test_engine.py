"""The engine against a naive reference loop, keyed randomness, stop conditions and bad input."""

import pytest
import torch

from rhymerl.engine.backends import native
from rhymerl.engine.engine import Engine
from rhymerl.engine.sampler import BLOCK, filtered_probs, keyed_uniforms, sample, sample_columns
from rhymerl.engine.sampling_params import SamplingParams, draw_key, request_key
from rhymerl.histospec.speculator import Speculator

from helpers import keyed_uniform_reference, reference_generate, reference_sample
from tiny_models import VOCAB, random_prompts, tiny_decoder


@pytest.fixture(scope="module")
def model():
    return tiny_decoder("llama")


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12),
    SamplingParams(temperature=1.0, max_tokens=12, seed=7),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=12, seed=3),
])
def test_engine_matches_reference(model, params):
    prompts = random_prompts(5, seed=1)
    eng = Engine(model, num_slots=2, max_model_len=64, eos_token_ids=[])
    outs = eng.generate(prompts, params, request_ids=[f"r{i}" for i in range(5)])
    for i, (p, o) in enumerate(zip(prompts, outs)):
        toks, logps = reference_generate(model, p, params, f"r{i}")
        assert o.token_ids == toks
        assert o.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(logps), atol=1e-4, rtol=1e-4)


def test_keyed_randomness_alone_or_in_any_batch(model):
    """A request's tokens depend on (seed, request id, position) only: alone in one slot, or in a mixed
    batch with other requests in another order and other slots, it samples the same tokens."""
    prompts = random_prompts(6, seed=2)
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=11)
    alone = [Engine(model, num_slots=1, max_model_len=64, eos_token_ids=[]).generate([p], params, request_ids=[i])[0]
             for i, p in enumerate(prompts)]
    mixed = Engine(model, num_slots=4, max_model_len=64, eos_token_ids=[]).generate(
        prompts[::-1] + random_prompts(3, seed=99), params, request_ids=[5, 4, 3, 2, 1, 0, "x", "y", "z"])
    assert [o.token_ids for o in alone] == [o.token_ids for o in mixed[:6][::-1]]
    # ... and a different seed or request id changes the result.
    other = Engine(model, num_slots=1, max_model_len=64, eos_token_ids=[]).generate(
        [prompts[0]], SamplingParams(temperature=1.0, max_tokens=20, seed=12), request_ids=[0])[0]
    assert other.token_ids != alone[0].token_ids


def test_continuous_batching_refills_slots(model):
    prompts = random_prompts(7, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (3, 9, 4, 8, 2, 6, 5)]
    eng = Engine(model, num_slots=3, max_model_len=64, eos_token_ids=[])
    outs = eng.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [3, 9, 4, 8, 2, 6, 5]
    # 37 tokens through 3 slots that are refilled at once: far fewer forwards than padded batches (9+8+5).
    assert eng.stats.forward_passes < 9 + 8 + 5
    assert eng.stats.generated_tokens == 37
    assert eng.stats.tokens_forwarded == 37 - 7 + sum(map(len, prompts))
    assert not eng.has_unfinished() and len(eng.scheduler.free_slots) == 3


def test_an_engine_on_an_earlier_engines_runner_gives_the_same_outputs(model):
    """`runner=`: a second engine on the first one's KV cache (stale keys/values of finished sequences in it)
    generates what a fresh engine does; a runner of another shape is refused, naming what differs."""
    prompts = random_prompts(6, seed=4)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=2)
    first = Engine(model, num_slots=3, max_model_len=64, eos_token_ids=[])
    first.generate(random_prompts(5, seed=9), params)
    fresh = Engine(model, num_slots=3, max_model_len=64, eos_token_ids=[]).generate(prompts, params)
    reused = Engine(model, num_slots=3, max_model_len=64, eos_token_ids=[], runner=first.runner)
    assert reused.cache is first.cache
    assert [o.token_ids for o in reused.generate(prompts, params)] == [o.token_ids for o in fresh]
    with pytest.raises(ValueError, match="room for 8 draft tokens"):
        Engine(model, num_slots=3, max_model_len=64, speculator=Speculator(None, max_draft_tokens=8),
               runner=first.runner)
    with pytest.raises(ValueError, match="4 slots"):
        Engine(model, num_slots=4, max_model_len=64, runner=first.runner)


def test_slots_are_compacted_once_the_queue_is_empty(model):
    """Finished sequences leave holes; the survivors move down (cache rows and all) and still decode
    exactly as they would have in place."""
    prompts = random_prompts(6, seed=31)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (2, 14, 3, 12, 4, 10)]
    eng = Engine(model, num_slots=6, max_model_len=64, eos_token_ids=[])
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(p, sp, i)
    outs, slot_of, moved = {}, {}, False
    while eng.has_unfinished():
        for ev in eng.step():
            if ev.output is not None:
                outs[ev.request_id] = ev.output
        slots = sorted(eng.scheduler.running)
        assert slots == list(range(len(slots)))  # always contiguous from 0
        for slot, seq in eng.scheduler.running.items():
            moved |= slot_of.setdefault(seq.request_id, slot) != slot
            slot_of[seq.request_id] = slot
    assert moved  # some request really did change slot mid-generation
    for i, p in enumerate(prompts):
        toks, _ = reference_generate(model, p, params[i], i)
        assert outs[i].token_ids == toks


def test_copies_of_a_prompt_prefill_once(model):
    """A GRPO group's copies of one prompt: the first prefills it, the others copy its keys/values, both
    from a co-admitted sequence and from one already running, and sample exactly what they sample alone."""
    prompt = random_prompts(1, lo=10, hi=10, seed=8)[0]
    other = random_prompts(1, lo=9, hi=9, seed=9)[0]
    batch = [prompt, prompt, other, prompt]
    params = [SamplingParams(temperature=1.0, max_tokens=n, seed=4) for n in (2, 9, 5, 6)]
    eng = Engine(model, num_slots=3, max_model_len=64, eos_token_ids=[])
    outs = eng.generate(batch, params, request_ids=["a", "b", "c", "d"])
    # "b" copies from "a" (admitted together); "d" is admitted when "a" finishes and copies from "b".
    assert eng.stats.shared_prompt_tokens == 2 * (len(prompt) - 1)
    assert eng.stats.prompt_tokens == len(prompt) + 2 + len(other)
    for p, sp, rid, out in zip(batch, params, "abcd", outs):
        alone = Engine(model, num_slots=1, max_model_len=64, eos_token_ids=[]).generate([p], sp, request_ids=[rid])[0]
        assert out.token_ids == alone.token_ids
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)


def test_a_shared_chat_prefix_is_copied_and_the_rest_prefilled(model):
    head = random_prompts(1, lo=12, hi=12, seed=10)[0]
    prompts = [head + tail for tail in random_prompts(3, lo=3, hi=6, seed=11)]
    params = SamplingParams(temperature=0.8, max_tokens=6, seed=2)
    eng = Engine(model, num_slots=3, max_model_len=64, eos_token_ids=[])
    outs = eng.generate(prompts, params, request_ids=[0, 1, 2])
    assert eng.stats.shared_prompt_tokens == 2 * len(head)
    assert eng.stats.prompt_tokens == sum(map(len, prompts)) - 2 * len(head)
    for i, (p, out) in enumerate(zip(prompts, outs)):
        assert out.token_ids == reference_generate(model, p, params, i)[0]


def test_stops_on_eos(model):
    prompt = random_prompts(1, seed=4)[0]
    free = Engine(model, num_slots=1, max_model_len=64, eos_token_ids=[]).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10))[0]
    eos = free.token_ids[3]
    first = free.token_ids.index(eos)
    out = Engine(model, num_slots=1, max_model_len=64, eos_token_ids=[eos]).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    ignore = Engine(model, num_slots=1, max_model_len=64, eos_token_ids=[eos]).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert ignore.token_ids == free.token_ids


class CharTokenizer:
    """Token t decodes to chr(65 + t % 26): enough to test stop strings."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(65 + t % 26) for t in ids)


def test_stops_on_stop_string(model):
    prompt = random_prompts(1, seed=6)[0]
    tok = CharTokenizer()
    free = Engine(model, tok, num_slots=1, max_model_len=64, eos_token_ids=[]).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    stop = free.text[4:6]
    out = Engine(model, tok, num_slots=1, max_model_len=64, eos_token_ids=[]).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, stop=(stop,)))[0]
    cut = free.text.index(stop)
    assert out.finish_reason == "stop"
    assert out.text == free.text[:cut]
    assert out.token_ids == free.token_ids[: cut + len(stop)]


def test_context_limit_finishes_with_length(model):
    out = Engine(model, num_slots=1, max_model_len=16, eos_token_ids=[]).generate(
        [[1] * 10], SamplingParams(temperature=0, max_tokens=100))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_bad_requests_are_rejected_alone(model):
    eng = Engine(model, num_slots=2, max_model_len=32, eos_token_ids=[])
    good = random_prompts(2, seed=5)
    outs = eng.generate([good[0], [], [1] * 40, [VOCAB + 5], good[1]], SamplingParams(temperature=0, max_tokens=4))
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "length"]
    assert "empty prompt" in outs[1].error
    assert "40 tokens" in outs[2].error and "max_model_len" in outs[2].error
    assert "outside the vocabulary" in outs[3].error
    assert all(len(outs[i].token_ids) == 4 for i in (0, 4))
    with pytest.raises(ValueError, match="empty prompt list"):
        eng.generate([], SamplingParams())


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"max_tokens": 0}, "max_tokens"), ({"temperature": float("nan")}, "temperature"),
])
def test_invalid_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_distribution_matches_softmax():
    """Keyed two-level Gumbel-max draws from the filtered softmax (chi-square check), over a vocabulary of
    several blocks so that both levels are exercised."""
    logits = torch.full((1, 3 * BLOCK + 7), -30.0)
    hot = torch.tensor([3, 40, 200, 300, 600, 770, 771])  # blocks 0, 0, 0, 1, 2, 3, 3
    logits[0, hot] = torch.tensor([2.0, 1.9, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=6)
    # By hand: top-k drops 771 (and the -30 tokens); the mass before 600 is 0.957 of the top 6 >= 0.95, so
    # top-p drops 600 and 770.
    n = 4000
    keys = [draw_key(0, request_key(i), 0) for i in range(n)]
    toks, _ = sample(logits.expand(n, -1), params, keys)
    probs = filtered_probs(torch.softmax(logits / params.temperature, -1), params)[0].double()
    kept = probs > 0
    assert kept.nonzero()[:, 0].tolist() == [3, 40, 200, 300]
    expected = probs / probs.sum() * n
    counts = torch.bincount(torch.tensor(toks), minlength=logits.shape[1]).double()
    assert counts[~kept].sum() == 0  # removed tokens are never drawn
    chi2 = (((counts - expected)[kept]) ** 2 / expected[kept]).sum()
    assert chi2 < 16.3  # p = 0.001 for 3 degrees of freedom


def test_keyed_uniforms_match_the_python_reference_and_sampler_matches_reference():
    keys = torch.tensor([draw_key(s, request_key(f"r{s}"), s * 7) for s in range(6)])
    cols = torch.tensor([0, 1, 255, 256, 12345, (1 << 40) + 5])
    u = keyed_uniforms(keys, cols)
    assert ((u > 0) & (u < 1)).all()
    for r in range(len(keys)):
        for c in range(len(cols)):
            assert u[r, c].item() == keyed_uniform_reference(int(keys[r]), int(cols[c]))
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(32, 1000, generator=g) * (torch.rand(32, 1000, generator=g) < 0.3)  # many zeros
    probs[:, -5:] = 0.0
    probs[:, 600] += 1e-3  # every row has a positive entry
    keys = torch.tensor([draw_key(1, 2, p) for p in range(32)])
    got = sample_columns(probs, keys)[:, 0].tolist()
    assert got == [reference_sample(probs[r].double().tolist(), int(keys[r])) for r in range(32)]
    assert all(probs[r, c] > 0 for r, c in enumerate(got))


def test_draws_survive_last_bit_perturbations():
    """The point of Gumbel-max over an inverse CDF: relative perturbations of 1e-6 in the logits, a fp32
    rounding difference between two forward shapes, change none of 2000 draws from a 49152-token
    distribution at temperature 1 (the inverse CDF this sampler replaced changed 16 of them: its
    boundaries carry the rounding error summed over every column before them)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2000, 49152, generator=g) * 3
    noisy = logits * (1 + 1e-6 * torch.randn(logits.shape, generator=g))
    params = SamplingParams(temperature=1.0)
    keys = [draw_key(5, request_key(i), 3) for i in range(2000)]
    assert sample(logits, params, keys)[0] == sample(noisy, params, keys)[0]


native_ops = native.ops()


@pytest.mark.skipif(native_ops is None, reason="fused CPU kernels unavailable here (no C++ compiler?)")
@pytest.mark.parametrize("temperature", [0.05, 0.3, 1.0, 1.7])
@pytest.mark.parametrize("vocab", [49152, 3 * BLOCK + 7, 10])  # whole blocks, a short last block, one block
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_sampler_draws_what_the_torch_sampler_draws(temperature, vocab, dtype):
    """`sample_rows` (the fused kernels' plain case) against `sample`'s torch code on the same keys and rows
    (every other row of the logits, read in place): the same tokens (its exp differs by a few ulp, which
    keyed Gumbel-max shrugs off) and log-probs to 1e-5."""
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(1200, vocab, generator=g) * 4).to(dtype)
    params = SamplingParams(temperature=temperature)
    keys = [draw_key(9, request_key(i), i % 7) for i in range(600)]
    rows = list(range(1, 1200, 2))
    want_tokens, want_logprobs = sample(logits, params, keys, rows=rows)
    got_tokens, got_logprobs = sample(logits, params, keys, native_ops, rows)
    assert got_tokens == want_tokens
    torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(want_logprobs), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(native_ops is None, reason="fused CPU kernels unavailable here (no C++ compiler?)")
def test_native_sampler_distribution_matches_softmax():
    """Chi-square check of `sample_rows` over a vocabulary of several blocks (both levels exercised)."""
    logits = torch.full((1, 3 * BLOCK + 7), -30.0)
    hot = torch.tensor([3, 40, 200, 300, 600, 770, 771])
    logits[0, hot] = torch.tensor([2.0, 1.9, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 4000
    keys = [draw_key(1, request_key(i), 0) for i in range(n)]
    toks, _ = sample(logits.expand(n, -1).contiguous(), SamplingParams(temperature=0.8), keys, native_ops)
    expected = torch.softmax(logits[0].double() / 0.8, -1) * n
    counts = torch.bincount(torch.tensor(toks), minlength=logits.shape[1]).double()
    assert counts.sum() == n and counts[hot].sum() >= n - 5  # the -30 tokens hold 1e-13 of the mass
    chi2 = (((counts - expected)[hot]) ** 2 / expected[hot]).sum()
    assert chi2 < 22.5  # p = 0.001 for 6 degrees of freedom
