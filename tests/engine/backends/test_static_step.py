"""The fixed-shape step that CUDA graphs replay (`static_step.py`), run eagerly on the CPU through the CUDA
backend with graphs off: the same logits and the same cache as the eager backend, padding that changes
nothing, and engine outputs equal to the eager engine's with and without HistoSpec."""

import pytest
import torch

from rhymerl.engine.backends import CudaBackend, EagerBackend
from rhymerl.engine.backends.op_trace import OpTrace
from rhymerl.engine.backends.static_forward import rope_table, rotate
from rhymerl.engine.backends.static_step import StaticStep, bucket_of, buckets
from rhymerl.engine.engine import Engine
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.model_runner import ModelRunner, SlotInput, _ancestors
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.model.decoder import apply_rope
from helpers import history_of, peaky, speculator
from tiny_models import random_prompts, tiny_decoder


def test_buckets_round_up_to_powers_of_two_and_the_limit():
    assert buckets(12) == [1, 2, 4, 8, 12]
    assert buckets(64, 64) == [64] and buckets(1) == [1]
    assert buckets(300, 64) == [64, 128, 256, 300]
    assert bucket_of(5, [1, 2, 4, 8, 12]) == 8 and bucket_of(13, [1, 2, 4, 8, 12]) is None


def runners(arch="llama", slots=8, max_len=96, scratch=8, dtype=torch.float32):
    """(model, eager runner, static runner): two runners, each over its own cache, on the same model."""
    model = tiny_decoder(arch, dtype)
    c = model.cfg

    def cache():
        return KVCache(c.num_layers, slots, max_len, c.num_kv_heads, c.head_dim, dtype, "cpu", scratch)

    eager = ModelRunner(model, cache(), fused=False)
    static = ModelRunner(model, cache(), fused=False)
    static.backend = CudaBackend(model, static.cache, "static")
    assert isinstance(eager.backend, EagerBackend) and not isinstance(eager.backend, CudaBackend)
    return model, eager, static


def both(eager, static, inputs):
    a, b = eager.run(inputs), static.run(inputs)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    return a


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama-d64"])
def test_decode_and_tree_steps_match_the_eager_backend(arch):
    model, eager, static = runners(arch)
    prompts = random_prompts(4, lo=5, hi=20, seed=3)
    slots = [0, 2, 3, 6]  # rows 1, 4, 5 (and 7 of the 8-row bucket) are padding
    # prefill, last logits only: chains of more than 9 tokens gathered, the shorter ones by slot
    both(eager, static, [SlotInput(s, 0, p[:-1], logits_from=len(p) - 2) for s, p in zip(slots, prompts)])
    assert static.backend.replays == 2 and static.backend.eager_parts == 0
    # a decode step: one token per row
    both(eager, static, [SlotInput(s, len(p) - 1, p[-1:]) for s, p in zip(slots, prompts)])
    assert static.backend.replays == 3
    # a verification step: trees of 1, 4 and 7 tokens beside a plain row, over the committed prefixes
    trees = [([-1], 1), ([-1, 0, 1, 2], 4), ([-1, 0, 0, 1, 1, 2, 3], 7), ([-1], 1)]
    inputs = [SlotInput(s, len(p), [7 + k for k in range(n)], parents)
              for s, p, (parents, n) in zip(slots, prompts, trees)]
    both(eager, static, inputs)
    # the cache's live part agrees: committed prefixes and this step's tree nodes
    for s, p, (_, n) in zip(slots, prompts, trees):
        torch.testing.assert_close(static.cache.kv[:, s, :, : len(p) + n], eager.cache.kv[:, s, :, : len(p) + n],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_from_the_table_is_the_decoders_rope(dtype):
    """A fixed-shape step gathers its tokens' rope rotations from a table of every cache position (one op)
    and applies them in two (`static_forward.rotate`): at those positions, whatever the step's size, the bits
    of x * cos + rotate_half(x) * sin with each product rounded (the decoder's `apply_rope` fuses the second
    into its addcmul: the same values to one rounding); the value heads come out unchanged."""
    model, _, static = runners("qwen3", dtype=dtype)
    c = model.cfg
    table = rope_table(model, static.cache)
    g = torch.Generator().manual_seed(4)
    for n in (1, 7, 33, 104):
        positions = torch.randint(0, static.cache.capacity, (n,), generator=g)
        qkv = torch.randn(n, c.num_heads + 2 * c.num_kv_heads, c.head_dim, generator=g).to(dtype)
        cos, sin = model.qkv_rope(positions, dtype)
        got = rotate(qkv, table.index_select(0, positions))
        x1, x2 = qkv.chunk(2, -1)
        assert torch.equal(got, qkv * cos + torch.cat((x2, x1), -1) * sin)
        tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(got, apply_rope(qkv, cos, sin), **tol)
        v = c.num_heads + c.num_kv_heads
        assert torch.equal(got[:, v:], qkv[:, v:])


def test_a_step_multiplies_by_the_weights_as_they_are_now():
    """The fixed-shape forward reads the parameters where they live (no copies), so weights changed in place
    (a weight sync: `RolloutWorker.load_weights`) are what the next step multiplies by, as a CUDA graph's
    replay would."""
    model, eager, static = runners("qwen2")
    prompts = random_prompts(2, lo=5, hi=9, seed=6)
    both(eager, static, [SlotInput(s, 0, p, logits_from=len(p) - 1) for s, p in zip((0, 3), prompts)])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    both(eager, static, [SlotInput(s, len(p), [s + 1]) for s, p in zip((0, 3), prompts)])


def test_padding_leaves_every_other_cache_position_as_it_was():
    model, _, static = runners()
    kv = static.cache.kv
    kv.copy_(torch.randn_like(kv))  # stale keys/values everywhere: padding must write none of them
    before = kv.clone()
    inputs = [SlotInput(1, 10, [5]), SlotInput(4, 20, [6, 7, 8], [-1, 0, 0])]
    static.run(inputs)
    assert static.backend.replays == 1
    written = torch.zeros(kv.shape[1], kv.shape[3], dtype=torch.bool)
    written[1, 10] = True
    written[4, 20:23] = True
    # by slot, padding writes the cache's tail [max_len - 1, capacity), where no committed token lives
    written[:, 96 - 1 :] = True
    # [slots, positions, layers, 2KV, D]: every (slot, position) pair but the written ones is untouched
    assert torch.equal(kv.permute(1, 3, 0, 2, 4)[~written], before.permute(1, 3, 0, 2, 4)[~written])
    assert not torch.equal(kv[:, 4, :, 20:23], before[:, 4, :, 20:23])


def test_shapes_send_prefill_and_copied_prefixes_to_the_eager_path():
    model, _, static = runners(slots=8, max_len=96, scratch=8)
    shapes = static.backend.shapes
    assert shapes.rows == [1, 2, 4, 8] and shapes.tokens == [1, 2, 4, 8, 9] and shapes.keys == [64, 104]
    assert shapes.chains == [16, 32, 64, 104]
    assert shapes.of([SlotInput(2, 30, [1])]) == (False, 4, 1, 64)  # by slot: rows 0-3
    assert shapes.of([SlotInput(0, 70, [1] * 9), SlotInput(5, 3, [1])]) == (False, 8, 9, 104)
    assert shapes.of([SlotInput(6, 0, [1] * 10, logits_from=9)]) == (True, 1, 16, 64)  # a prefill, gathered
    assert shapes.of([SlotInput(6, 0, [1] * 10)]) is None  # a chain wanting every logit: eager
    assert shapes.of([SlotInput(6, 90, [1] * 20, logits_from=19)]) is None  # 90 + 32 > capacity 104: eager
    assert shapes.of([SlotInput(1, 8, [1], prefix_from=0)]) is None  # copies slot 0's prefix


def test_every_bucket_runs_on_padding_alone_and_changes_no_cache_entry():
    """What a bench does before its timed runs (`capture_every_shape`: on a GPU, a capture per bucket): every
    shape `of` can give is in `every`, and running each bucket on padding alone leaves the cache bit for bit
    below its tail [max_len - 1, capacity), which no committed token reaches (by slot, padding writes there)."""
    model, eager, static = runners("qwen2", slots=2, max_len=40, scratch=8)
    shapes = static.backend.shapes
    every = shapes.every()
    assert len(every) == len(set(every)) == 2 * 5 + 2 * 3  # rows 1, 2 x tokens 1-9 | chains 16, 32, 48; keys 48
    samples = [[SlotInput(1, 30, [1])], [SlotInput(0, 39, [1] * 9), SlotInput(1, 3, [1])],
               [SlotInput(1, 0, [1] * 10, logits_from=9)], [SlotInput(s, 0, [1] * 20, logits_from=19) for s in (0, 1)],
               [SlotInput(1, 0, [1] * 40, logits_from=39)]]
    for inputs in samples:
        assert shapes.of(inputs) in every
    kv = static.cache.kv
    kv.copy_(torch.randn_like(kv))
    before = kv.clone()
    done, seconds = static.backend.capture_every_shape()
    assert done == len(every) and seconds > 0 and torch.equal(kv[:, :, :, :39], before[:, :, :, :39])
    assert static.backend.capture_every_shape()[0] == 0  # nothing new to capture
    # and the backend still computes the eager backend's logits
    prompts = random_prompts(2, lo=5, hi=12, seed=5)
    eager.cache.kv.copy_(kv)
    both(eager, static, [SlotInput(s, 0, p, logits_from=len(p) - 1) for s, p in zip((0, 1), prompts)])


def test_every_shape_is_run_for_every_draw_kind_of_the_runs_before_them():
    """`capture_every_shape` with the SamplingParams a run uses (issue 34 item 2: every shape before any timed
    region): each bucket once per draw kind (greedy, temperature sampling, top-p), a second temperature adds
    nothing (its graphs are the first's), and an engine then generating with each of them runs no (bucket,
    draw kind) pair for the first time (`first_runs`: on a GPU, a capture); with the default kind alone, a
    greedy run does."""
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.9)]
    prompts = random_prompts(4, lo=5, hi=12, seed=8)
    for captured, first_later in ((kinds, False), ([SamplingParams()], True)):
        model, _, static = runners(slots=4, max_len=40, scratch=0)
        backend = static.backend
        done, _ = backend.capture_every_shape(12, captured)
        assert done == len(backend.shapes.every(12)) * len(captured) == backend.first_runs
        assert backend.capture_every_shape(12, [SamplingParams(temperature=0.3)])[0] == 0
        engine = Engine(model, num_slots=4, max_model_len=40, eos_token_ids=[], runner=static)
        before = backend.first_runs
        for params in kinds:
            engine.generate(prompts, SamplingParams(temperature=params.temperature, top_p=params.top_p, max_tokens=6))
        assert (backend.first_runs > before) == first_later


def test_capturing_every_shape_records_no_autograd_graph(monkeypatch):
    """A bench calls `capture_every_shape` outside `ModelRunner.run`, with autograd on and the weights
    requiring grad: each bucket's step must still run in inference mode, or (on a GPU) every captured graph's
    logits would keep the step's activations alive for a backward that never comes (an H200 ran out of its
    139 GiB that way)."""
    _, _, static = runners(slots=2, max_len=40, scratch=8)
    assert torch.is_grad_enabled() and any(p.requires_grad for p in static.model.parameters())
    outputs = []
    run = StaticStep.run
    monkeypatch.setattr(StaticStep, "run", lambda self: outputs.append(run(self)) or outputs[-1])
    done, _ = static.backend.capture_every_shape()
    assert done == len(outputs) > 0
    assert all(x.grad_fn is None and not x.requires_grad for x in outputs)


def test_a_mixed_step_runs_in_parts_and_keeps_the_step_order():
    """Prefill chains, decode rows and prefix copiers in one step (an admission step of a GRPO rollout): the
    eager backend's logits, in the step's order, and its cache."""
    model, eager, static = runners("qwen2", slots=8)
    a, b, c = random_prompts(3, lo=14, hi=24, seed=9)
    warm = [SlotInput(0, 0, a[:-1], logits_from=len(a) - 2), SlotInput(3, 0, b[:-1], logits_from=len(b) - 2)]
    both(eager, static, warm)
    step = [SlotInput(0, len(a) - 1, a[-1:]),  # decode
            SlotInput(1, 0, c, logits_from=len(c) - 1),  # a prefill, gathered
            SlotInput(2, 12, c[12:], logits_from=len(c) - 13, prefix_from=1),  # copies c's prefix from slot 1
            SlotInput(3, len(b) - 1, b[-1:] + [4, 5], [-1, 0, 0]),  # a draft tree
            SlotInput(5, 10, a[10:], logits_from=len(a) - 11, prefix_from=0)]  # copies a's prefix from slot 0
    logits = both(eager, static, step)
    assert logits.shape[0] == 1 + 1 + 1 + 3 + 1
    for s, n in ((0, len(a)), (1, len(c)), (2, len(c)), (3, len(b) + 2), (5, len(a))):
        torch.testing.assert_close(static.cache.kv[:, s, :, :n], eager.cache.kv[:, s, :, :n], atol=1e-5, rtol=1e-5)
    assert static.backend.eager_parts == 0


@pytest.mark.parametrize("temperature,max_model_len", [(0.0, 64), (1.0, 64), (1.0, 20)])
def test_engine_outputs_equal_the_eager_engine(temperature, max_model_len):
    """Plain and HistoSpec decoding through the static steps give the eager engine's tokens (fp32). With
    max_model_len 20 most responses run to the context's end, their drafts into the cache's tail, where by
    slot the padding tokens write."""
    model = peaky(tiny_decoder("llama-d64"))
    prompts = random_prompts(5, seed=11)
    params = SamplingParams(temperature=temperature, max_tokens=24, seed=3)
    history = history_of(model, prompts, params)
    batch = [p for p in prompts for _ in range(2)]
    ids = [f"p{i}-g{g}" for i in range(5) for g in range(2)]

    def engine(spec, static):
        e = Engine(model, num_slots=4, max_model_len=max_model_len, eos_token_ids=[],
                   speculator=speculator(spec, history))
        if static:
            e.runner.backend = CudaBackend(model, e.cache, "static")
        return e

    reference = engine("off", False).generate(batch, params, request_ids=ids)
    if max_model_len == 20:
        assert sum(len(p) + len(o.token_ids) == 20 for p, o in zip(batch, reference)) >= 6
    for spec in ("off", "histospec"):
        e = engine(spec, True)
        outs = e.generate(batch, params, request_ids=ids)
        assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
        for a, b in zip(outs, reference):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)
        assert e.runner.backend.replays > 0 and e.runner.backend.eager_parts == 0


# ops that read a device value on the host (a synchronisation, which a capture forbids) or whose output shape
# depends on the data (a replay cannot change a shape); repeat_interleave does when its repeats are a tensor
HOST_READS = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "tolist", "repeat_interleave")


@pytest.mark.parametrize("gathered", [False, True])
def test_a_static_step_runs_the_same_ops_on_the_same_shapes_whatever_it_holds(gathered):
    """What makes a step capturable, checked on the CPU: two different steps of one bucket run the very same
    ops on the very same shapes, none of which reads data back to the host."""
    model, _, static = runners("llama-d64", slots=8, max_len=96, scratch=8)
    backend = static.backend
    rng = torch.Generator().manual_seed(0)
    traces = []
    for seed in (1, 2):
        prompts = random_prompts(3, lo=10 if gathered else 2, hi=16 if gathered else 8, seed=seed)
        if gathered:
            inputs = [SlotInput(s, 0, p, logits_from=len(p) - 1) for s, p in zip((1, 4, 6), prompts)]
        else:  # a verification step: a tree, a chain, a decode row, at other bases each time
            base = int(torch.randint(5, 40, (1,), generator=rng))
            inputs = [SlotInput(0, base, prompts[0][:1] + [3, 4, 5], [-1, 0, 0, 1]),
                      SlotInput(2, base + 7, prompts[1][:3]), SlotInput(5, base + 1, prompts[2][:1])]
        shape = backend.shapes.of(inputs)
        assert shape is not None and shape[0] == gathered
        step = StaticStep(model, static.cache, *shape)
        step.load(inputs, [_ancestors(x.parents, len(x.tokens)) for x in inputs])
        with torch.inference_mode(), OpTrace() as trace:
            step.run()
        traces.append(trace.ops)
    assert traces[0] == traces[1] and len(traces[0]) > 50
    assert not [op for op, _, _ in traces[0] if any(name in op for name in HOST_READS)]


def test_a_prompt_prefilled_in_gathered_chunks_sees_its_earlier_chunks():
    """Chunks of 12 and 20 tokens after 10 committed ones (an adopted request's re-prefill, a long prompt):
    gathered chains over a committed prefix give the eager backend's last-token logits."""
    model, eager, static = runners("qwen3", slots=4)
    p = random_prompts(1, lo=42, hi=42, seed=13)[0]
    both(eager, static, [SlotInput(2, 0, p[:10], logits_from=9)])
    both(eager, static, [SlotInput(2, 10, p[10:22], logits_from=11), SlotInput(0, 0, p[:20], logits_from=19)])
    both(eager, static, [SlotInput(2, 22, p[22:42], logits_from=19)])
    assert static.backend.eager_parts == 0 and static.backend.shapes.of(
        [SlotInput(2, 22, p[22:42], logits_from=19)])[0]  # gathered


# Computing ops (on a GPU, kernels) of a llama layer in a 32-slot fixed-shape step (`static_forward`): two
# RMSNorms with their weights (1 each), 4 matmuls (qkv; o_proj and down, each with its residual add), rope
# (2), the K/V write (1), attention (1), SiLU x up (2); trees of 8 tokens (a drafting bucket) add 2 copies
# that fold the query heads for attention and back. `Decoder.forward_packed`, which the step ran before,
# launched 17 and 19. Per step outside the layers, the forward's: the rope rows (1), the mask (2 for one token
# a row, 5 for trees; 11 and 12 before, in fp32), the embedding, the final norm, the lm_head.
LAUNCHES_PER_LAYER = {1: 12, 8: 14}
LAUNCHES_PER_STEP = {1: 6, 8: 9}


@pytest.mark.parametrize("tokens", [1, 8])
def test_a_step_launches_at_most_so_many_kernels_per_layer(tokens):
    """The fused forward's launch count (op_trace: what `bench engine` reports as kernels per step), per layer
    and per step, for a plain decode step of 32 slots and a drafting bucket of 32 trees of 8 tokens."""
    model = tiny_decoder("llama-d64")
    c, layers = model.cfg, model.layers
    cache = KVCache(c.num_layers, 32, 96, c.num_kv_heads, c.head_dim, torch.float32, "cpu", 8)

    def launches(n_layers: int) -> int:
        model.layers = layers[:n_layers]
        step = StaticStep(model, cache, False, 32, tokens, 64)
        step.load([], [])
        with torch.inference_mode(), OpTrace() as trace:
            step.run()
        return trace.launches

    one, two = launches(1), launches(2)
    assert two - one <= LAUNCHES_PER_LAYER[tokens]
    assert one - (two - one) <= LAUNCHES_PER_STEP[tokens]
