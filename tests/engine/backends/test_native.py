"""The fused CPU kernels (rhymerl.engine.backends.native) against the eager decoder layer they replace.

tests/engine/test_model_runner.py runs every cached forward mode through both paths in fp32 against dense
recomputation; here each kernel is compared with the eager code piece by piece, in fp32 and bf16."""

import re
from contextlib import nullcontext

import pytest
import torch

from rhymerl.engine.backends import CpuBackend, EagerBackend, native
from rhymerl.engine.backends.cpu_attention import FusedAttention, OneCallAttention
from rhymerl.engine.backends.cpu_weights import ONEDNN, PLAIN, TILES, model_weights, prepacked_linears
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.model_runner import ModelRunner, SlotInput
from rhymerl.model.decoder import apply_rope, rope_tables
from tiny_models import random_prompts, tiny_decoder

ops = native.ops()
needs_kernels = pytest.mark.skipif(ops is None, reason="fused CPU kernels unavailable here (no C++ compiler?)")
needs_tiles = pytest.mark.skipif(ops is None or not ops.tile_linear_supported(),
                                 reason="no AMX-BF16 tiles on this CPU (or no fused kernels)")

# bf16 results may differ from eager by a rounding of the RMSNorm mean's summation order or of SiLU's exp.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_layer_kernels_match_the_eager_layer(arch, dtype):
    model = tiny_decoder(arch, dtype)
    weights = model_weights(model)
    layout = ONEDNN if weights.packable() else PLAIN
    with torch.inference_mode(), prepacked_linears(model) if layout == ONEDNN else nullcontext():
        check_layer(model, layout, dtype, weights.onednn if layout == ONEDNN else lambda lin: lin.weight)


@needs_tiles
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_layer_kernels_on_amx_tiles_match_the_eager_layer(arch):
    model = tiny_decoder(arch, torch.bfloat16)
    weights = model_weights(model)
    assert weights.tiles_fit()
    with torch.inference_mode():
        check_layer(model, TILES, torch.bfloat16, lambda lin: weights.tiles(lin, ops.pack_tiles))


def check_layer(model, layout, dtype, weight):
    layer, cfg = model.layers[1], model.cfg
    attn, h, kv, d = layer.self_attn, layer.self_attn.h, layer.self_attn.kv, layer.self_attn.d
    g = torch.Generator().manual_seed(0)
    n = 5
    x, r = (torch.randn(n, cfg.hidden_size, generator=g).to(dtype) for _ in range(2))
    positions = torch.tensor([3, 4, 9, 0, 7])
    slot_of, write_pos = torch.tensor([0, 0, 2, 1, 2]), torch.tensor([3, 4, 9, 0, 7])
    cos, sin = rope_tables(positions, model.inv_freq, dtype)
    cache = torch.zeros(3, 2 * kv, 12, d, dtype=dtype)
    s, q = ops.pre_attn(x, r, layer.input_layernorm.weight, weight(attn.qkv_proj), attn.qkv_proj.bias, layout,
                        attn.q_norm.weight if attn.q_norm is not None else None,
                        attn.k_norm.weight if attn.k_norm is not None else None,
                        cos, sin, cache, slot_of, write_pos, h, kv, cfg.rms_norm_eps)
    # eager: the same pieces as Attention.forward
    s_ref = x + r
    qkv = attn.qkv_proj(layer.input_layernorm(s_ref)).view(n, h + 2 * kv, d)
    qk = qkv[:, : h + kv]
    if attn.q_norm is not None:
        qk = torch.cat((attn.q_norm(qkv[:, :h]), attn.k_norm(qkv[:, h : h + kv])), dim=1)
    qk = apply_rope(qk, cos, sin)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(q, qk[:, :h], **TOL[dtype])
    written = cache[slot_of, :, write_pos]  # [n, 2KV, D]
    torch.testing.assert_close(written[:, :kv], qk[:, h:], **TOL[dtype])
    torch.testing.assert_close(written[:, kv:], qkv[:, h + kv :], **TOL[dtype])
    untouched = torch.ones(3, 12, dtype=torch.bool)
    untouched[slot_of, write_pos] = False
    assert not cache.permute(0, 2, 1, 3)[untouched].any()  # nothing else in the cache was written

    out = torch.randn(n, h * d, generator=g).to(dtype)
    s2, mlp_out = ops.post_attn(out, s, weight(attn.o_proj), layer.post_attention_layernorm.weight,
                                weight(layer.mlp.gate_up_proj), weight(layer.mlp.down_proj), layout, cfg.rms_norm_eps)
    s2_ref = s_ref + attn.o_proj(out)
    torch.testing.assert_close(s2, s2_ref, **TOL[dtype])
    torch.testing.assert_close(mlp_out, layer.mlp(layer.post_attention_layernorm(s2_ref)), **TOL[dtype])

    y = ops.add_rms_norm(s2, mlp_out, model.norm.weight, cfg.rms_norm_eps)[1]
    torch.testing.assert_close(y, model.norm(s2 + mlp_out), **TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-d64"])
def test_fused_forward_agrees_with_eager_in_bf16(arch):
    """A whole bf16 step (prefill, then decode rows and a draft tree): fused and eager logits agree
    to bf16 rounding and pick the same tokens."""
    model = tiny_decoder(arch, torch.bfloat16)
    c = model.cfg
    logits = {}
    for fused in (True, False):
        cache = KVCache(c.num_layers, 4, 64, c.num_kv_heads, c.head_dim, torch.bfloat16, "cpu", 16)
        runner = ModelRunner(model, cache, fused=fused)
        a, b = random_prompts(2, seed=3)
        runner.run([SlotInput(0, 0, a[:-1]), SlotInput(2, 0, b)])
        logits[fused] = runner.run([SlotInput(0, len(a) - 1, [a[-1], 5, 6, 7], [-1, 0, 0, 1]),
                                    SlotInput(2, len(b), [9])])
    torch.testing.assert_close(logits[True], logits[False], atol=5e-2, rtol=5e-2)
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))


def test_off_switch(monkeypatch):
    monkeypatch.setenv("RHYMERL_NATIVE", "0")
    assert native.ops() is None


def test_a_failed_build_falls_back_with_the_compilers_error(monkeypatch, tmp_path):
    def fail(**kwargs):
        raise RuntimeError("Error building extension 'rhymerl_native'\n[1/2] c++ -c native_kernels.cpp\n"
                           "native_kernels.cpp:12:1: error: 'foo' was not declared\nninja: build stopped")
    monkeypatch.delenv("RHYMERL_NATIVE", raising=False)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(native.cpp_extension, "load", fail)
    with pytest.warns(UserWarning, match="eager forward .*error: 'foo' was not declared"):
        assert native.ops() is None
    assert native.ops() is None  # tried once per process, not at every forward
    model = tiny_decoder("llama")
    c = model.cfg
    cache = KVCache(c.num_layers, 2, 32, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    runner = ModelRunner(model, cache)
    assert runner.ops is None and isinstance(runner.backend, EagerBackend)  # the engine runs the eager forward


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3", "llama-d64"])  # decode rows through SDPA, and the decode kernel
def test_one_call_stack_equals_the_per_layer_calls(monkeypatch, dtype, arch):
    """forward_layers (the whole stack in one call) against pre_attn/attend/post_attn per layer, on steps
    of every one-group shape: decode rows over a slot range with idle rows, gathered sparse slots, a
    draft tree beside a decode row (dense queries, folded heads), a prefix copied from another slot."""
    model = tiny_decoder(arch, dtype)
    c = model.cfg
    a, b, p = random_prompts(3, seed=21)
    steps = [
        [SlotInput(0, 0, a[:-1]), SlotInput(3, 0, b[:-1]), SlotInput(5, 0, p)],
        [SlotInput(0, len(a) - 1, a[-1:]), SlotInput(3, len(b) - 1, b[-1:])],  # a range with idle rows
        [SlotInput(0, len(a), [4]), SlotInput(5, len(p), [6])],  # sparse: rows gathered
        [SlotInput(0, len(a) + 1, [3, 5, 6, 7], [-1, 0, 0, 1]), SlotInput(5, len(p) + 1, [2])],  # tree + decode
        [SlotInput(1, 4, [8, 9], prefix_from=5)],  # the first 4 positions copied from slot 5
    ]
    original, used = FusedAttention.one_call_args, []

    def spy(self):
        args = original(self)
        used.append(args is not None)
        return args

    logits = {}
    for one_call in (True, False):
        cache = KVCache(c.num_layers, 6, 48, c.num_kv_heads, c.head_dim, dtype, "cpu", 16)
        runner = ModelRunner(model, cache)
        monkeypatch.setattr(FusedAttention, "one_call_args", spy if one_call else lambda self: None)
        logits[one_call] = [runner.run(step) for step in steps]
        monkeypatch.undo()
    assert used == [True] * len(steps)  # every step above is one group: forward_layers ran each time
    for got, want in zip(logits[True], logits[False]):
        assert torch.equal(got, want)


# forward_fused passes these positionally, then OneCallAttention by name.
LEADING = ["x", "weights", "layout", "cos", "sin", "cache", "slot_of", "write_pos", "h", "kv", "eps"]


def forward_layers_schema_in_source():
    """forward_layers' schema as kernels/layer.cpp declares it (no compiler needed)."""
    source = (native.KERNELS / "layer.cpp").read_text()
    literals = re.search(r'm\.def\(\s*((?:"[^"]*"\s*)+),\s*&forward_layers\)', source).group(1)
    return torch._C.parse_schema("".join(re.findall(r'"([^"]*)"', literals)))


def test_one_call_attention_names_the_trailing_arguments_of_forward_layers():
    """OneCallAttention's fields are forward_layers' trailing arguments, names and order: a reorder or a
    rename on either side fails here, not as a wrong attention."""
    names = [a.name for a in forward_layers_schema_in_source().arguments]
    assert names == LEADING + list(OneCallAttention._fields)


@needs_kernels
def test_the_built_forward_layers_has_the_arguments_forward_fused_passes():
    names = [a.name for a in ops.forward_layers.default._schema.arguments]
    assert names == LEADING + list(OneCallAttention._fields)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_runner_takes_the_fused_backend_unless_told_otherwise(monkeypatch, dtype):
    model = tiny_decoder("llama-d64", dtype)
    c = model.cfg
    cache = KVCache(c.num_layers, 2, 32, c.num_kv_heads, c.head_dim, dtype, "cpu")
    runner = ModelRunner(model, cache)
    assert isinstance(runner.backend, CpuBackend) and runner.ops is ops
    assert isinstance(ModelRunner(model, cache, fused=False).backend, EagerBackend)
    monkeypatch.setenv("RHYMERL_NATIVE", "0")
    runner = ModelRunner(model, cache)
    assert isinstance(runner.backend, EagerBackend) and runner.ops is None


@needs_kernels
def test_runner_move_and_commit_keep_the_tile_cache_current():
    """On AMX tiles the CPU backend keeps the tree attention's tile cache beside the KV cache: slots moved
    and paths committed through the runner attend exactly as with the tile cache forgotten at every step.
    (Elsewhere there is no tile cache and this checks the plain cache's moves and commits.)"""
    model = tiny_decoder("llama-d64", torch.bfloat16)
    c = model.cfg
    a, b = random_prompts(2, seed=31, lo=40, hi=60)  # past a 32-position block
    logits = {}
    for forget in (False, True):
        cache = KVCache(c.num_layers, 4, 96, c.num_kv_heads, c.head_dim, torch.bfloat16, "cpu", 16)
        runner = ModelRunner(model, cache)
        tiles = runner.backend.tile_cache

        def run(inputs):
            if forget and tiles is not None:
                tiles.blocks.zero_()
            return runner.run(inputs)

        out = [run([SlotInput(0, 0, a[:-1]), SlotInput(1, 0, b[:-1])]),
               run([SlotInput(0, len(a) - 1, a[-1:]), SlotInput(1, len(b) - 1, b[-1:])])]
        runner.move(1, 3, len(b))  # slot 1's sequence goes on in slot 3
        out.append(run([SlotInput(0, len(a), [3, 5, 6, 7], [-1, 0, 0, 1]), SlotInput(3, len(b), [9])]))
        runner.commit(0, len(a), [0, 2])
        out.append(run([SlotInput(0, len(a) + 2, [4]), SlotInput(3, len(b) + 1, [8])]))
        logits[forget] = out
    for got, want in zip(logits[False], logits[True]):
        assert torch.equal(got, want)


def tree_reference(q, cache, slot_of, base, anc):
    """fp64 attention of each token over its slot's keys [0, base) and base + j for the bits j of anc."""
    kv = cache.shape[1] // 2
    out = []
    for i in range(q.shape[0]):
        bits = int(anc[i]) & ((1 << 64) - 1)
        keys = list(range(int(base[i]))) + [int(base[i]) + j for j in range(64) if bits >> j & 1]
        rows = cache[slot_of[i], :, keys].double()
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[i].double()[:, None], rows[:kv], rows[kv:], enable_gqa=True)[:, 0])
    return torch.stack(out)


def tree_step(parents_per_slot, bases, slots):
    """(slot_of, base, anc) of a step in which slot s feeds a tree with the given parents (-1: the prefix)."""
    slot_of, base, anc = [], [], []
    for parents, b, s in zip(parents_per_slot, bases, slots):
        masks = []
        for i, p in enumerate(parents):
            masks.append((masks[p] if p >= 0 else 0) | 1 << i)
        slot_of += [s] * len(parents)
        base += [b] * len(parents)
        anc += [m - (1 << 64) if m >= 1 << 63 else m for m in masks]  # uint64 bits as int64
    return torch.tensor(slot_of), torch.tensor(base), torch.tensor(anc, dtype=torch.int64)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (14, 2, 64), (16, 8, 128), (4, 1, 128)])
def test_tree_attention_against_a_float64_reference(dtype, heads, kv_heads, head_dim):
    """The tree kernel (SmolLM2's and Qwen's head shapes) on one step holding decode rows at lengths around
    its 16-key blocks, a draft tree, a 64-token chain from an empty prefix and a prefix of 250: each
    token sees its prefix and its own ancestors only. The cache past each slot's step holds NaN, which
    must not reach the output."""
    if not ops.tree_attention_supports(head_dim, dtype):
        pytest.skip("no tree attention in this dtype on this CPU (bf16 needs AVX-512): SDPA serves every step")
    tree = [-1, 0, 0, 1, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 5]  # 19 tokens, depth 16
    parents = [[-1], [-1], [-1], tree, list(range(-1, 63)), [-1], [-1, 0, 1]]
    bases = [0, 14, 16, 37, 0, 250, 17]
    slots = [4, 0, 2, 6, 5, 1, 3]
    slot_of, base, anc = tree_step(parents, bases, slots)
    g = torch.Generator().manual_seed(0)
    cache = torch.full((7, 2 * kv_heads, 300, head_dim), float("nan"), dtype=dtype)
    for s, b, p in zip(slots, bases, parents):
        cache[s, :, : b + len(p)] = torch.randn(2 * kv_heads, b + len(p), head_dim, generator=g).to(dtype)
    q = torch.randn(len(slot_of), heads, head_dim, generator=g).to(dtype)
    out = ops.tree_attention(q, cache, slot_of, base, anc)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)  # bf16: its rounding
    torch.testing.assert_close(out.double(), tree_reference(q, cache, slot_of, base, anc), **tol)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verified_token_and_the_same_token_decoded_get_the_same_bits(dtype):
    """Tree attention's arithmetic per query depends only on its keys in order: a token on a draft-tree
    path and the same token decoded later, once its path is committed, attend identically."""
    if not ops.tree_attention_supports(64, dtype):
        pytest.skip("no tree attention in this dtype on this CPU (bf16 needs AVX-512)")
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(1, 6, 80, 64, generator=g).to(dtype)
    q = torch.randn(4, 9, 64, generator=g).to(dtype)
    # tree over base 40: 0 <- 1 <- 3 is a path; 2 hangs from 0. Token 3 sees keys [0, 40), 40, 41, 43.
    slot_of, base, anc = tree_step([[-1, 0, 0, 1]], [40], [0])
    tree_out = ops.tree_attention(q, cache, slot_of, base, anc)[3]
    committed = cache.clone()
    committed[0, :, 42] = cache[0, :, 43]  # the commit moves the path's last key next to the others
    decoded = ops.tree_attention(q[3:], committed, torch.tensor([0]), torch.tensor([42]), torch.tensor([1]))[0]
    assert torch.equal(tree_out, decoded)


@needs_kernels
def test_tree_attention_tile_cache_gives_the_bits_of_no_cache():
    """On AMX tiles the tree kernel keeps each slot's keys and values rearranged, block by block, across
    calls. Steps that grow the slots past block ends, a tree, and a slot rewritten from position 20 (after
    `tile_blocks` is cut back, as the engine does) attend exactly as calls that rearrange everything anew."""
    elems = ops.tree_attention_block_elems(64, torch.bfloat16)
    if elems == 0:
        pytest.skip("no AMX tiles here: the tree kernel keeps no tile cache")
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(3, 6, 160, 64, generator=g).to(torch.bfloat16)
    tiles = torch.zeros(3, 3, 5, elems, dtype=torch.bfloat16)
    blocks = torch.zeros(3, 3, dtype=torch.int64)
    for step, (bases, parents) in enumerate([([30, 0, 64], [[-1], [-1], [-1]]), ([31, 1, 65], [[-1], [-1], [-1]]),
                                             ([33, 40, 96], [[-1, 0, 0, 1], [-1], [-1, 0]]),
                                             ([70, 41, 127], [[-1], [-1, 0, 1, 2], [-1]])]):
        if step == 3:  # slot 1 gets a new sequence from position 20 on
            cache[1, :, 20:] = torch.randn(6, 140, 64, generator=g).to(torch.bfloat16)
            blocks[1] = torch.clamp(blocks[1], max=20 // 32)
        slot_of, base, anc = tree_step(parents, bases, [0, 1, 2])
        q = torch.randn(len(slot_of), 9, 64, generator=g).to(torch.bfloat16)
        cached = ops.tree_attention(q, cache, slot_of, base, anc, tiles, blocks)
        assert torch.equal(cached, ops.tree_attention(q, cache, slot_of, base, anc))
    assert blocks.tolist() == [[2] * 3, [1] * 3, [3] * 3]  # blocks wholly below each slot's last base


@needs_kernels
def test_tree_attention_declines_what_it_does_not_take():
    """Heads of 24 (Qwen3's tiny test size) or fp16: not supported, and the kernel returns None."""
    assert not ops.tree_attention_supports(24, torch.float32)
    assert not ops.tree_attention_supports(64, torch.float16)
    pos = torch.zeros(1, dtype=torch.long)
    assert ops.tree_attention(torch.zeros(1, 4, 24), torch.zeros(1, 4, 8, 24), pos, pos, pos + 1) is None
    if ops.tree_attention_supports(64, torch.float32):  # a slot's run of tokens is at most 64 (its ancestor bits)
        zeros = torch.zeros(65, dtype=torch.long)
        with pytest.raises(RuntimeError, match="at most 64 consecutive tokens"):
            ops.tree_attention(torch.zeros(65, 4, 64), torch.zeros(1, 4, 80, 64), zeros, zeros, zeros + 1)
        one = torch.ones(1, dtype=torch.long)
        with pytest.raises(RuntimeError, match="reads outside the cache"):  # key 80 of a cache of 80
            ops.tree_attention(torch.zeros(1, 4, 64), torch.zeros(1, 4, 80, 64), pos, pos + 80, one)
        with pytest.raises(RuntimeError, match="reads outside the cache"):  # slot 1 of 1
            ops.tree_attention(torch.zeros(1, 4, 64), torch.zeros(1, 4, 80, 64), one, pos, one)


def test_fp16_on_a_cpu_runs_the_eager_forward():
    """The kernels take fp32 and bf16 only: an fp16 engine on a CPU must not reach them (it used to fail
    with '"add_rms_norm" not implemented for Half'), and its logits are the eager forward's."""
    model = tiny_decoder("llama", torch.float16)
    c = model.cfg
    cache = KVCache(c.num_layers, 2, 32, c.num_kv_heads, c.head_dim, torch.float16, "cpu")
    runner = ModelRunner(model, cache)
    assert runner.ops is None and isinstance(runner.backend, EagerBackend)
    prompt = random_prompts(1, seed=4)[0]
    logits = runner.run([SlotInput(0, 0, prompt)])
    with torch.no_grad():
        dense = model(torch.tensor([prompt]))[0].float()
    torch.testing.assert_close(logits, dense, atol=1e-2, rtol=1e-2)


@needs_tiles
@pytest.mark.parametrize("m,n,k,bias", [(1, 64, 64, False), (17, 160, 80, True), (33, 16, 32, False),
                                        (5, 48, 100, True), (70, 96, 576, False), (40, 960, 576, True)])
def test_tile_linear_against_a_float_reference(m, n, k, bias):
    """Odd row counts, K not a multiple of 32, an odd number of 16-column blocks, a bias: every element is
    the fp32 sum of the bf16 products (+ bias) rounded once to bf16, up to fp32 summation order; and a row
    gets the same bits alone as in a batch (a verified and a decoded token see the same matmuls)."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    tiles = ops.pack_tiles(w)
    y = ops.tile_linear(x, tiles, b)
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # one bf16 rounding (2^-8 relative) plus the fp32 summation order
    assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-4 * k).all()
    for i in (0, m - 1):
        assert torch.equal(ops.tile_linear(x[i : i + 1].contiguous(), tiles, b)[0], y[i])
    assert torch.equal(ops.linear(x, tiles, b, TILES), y)
    assert torch.equal(ops.tile_linear(x.t().contiguous().t(), tiles, b), y)  # a strided x is read as well


@needs_tiles
def test_tile_linear_rejects_what_it_cannot_multiply():
    w = torch.randn(32, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.pack_tiles(torch.randn(24, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16"):
        ops.pack_tiles(w.float())
    with pytest.raises(RuntimeError, match="K matching"):
        ops.tile_linear(torch.randn(3, 100).to(torch.bfloat16), ops.pack_tiles(w), None)
    with pytest.raises(RuntimeError, match="unknown weight layout"):
        ops.linear(torch.randn(3, 64).to(torch.bfloat16), w, None, 7)


@needs_tiles
def test_tile_copies_follow_the_weight():
    """A weight sync or optimizer step changes the parameter in place: the next forward repacks its tiles."""
    model = tiny_decoder("llama", torch.bfloat16)
    lin, weights = model.layers[0].mlp.down_proj, model_weights(model)
    x = torch.randn(3, lin.in_features).to(torch.bfloat16)
    with torch.inference_mode():
        before = ops.tile_linear(x, weights.tiles(lin, ops.pack_tiles), None)
    with torch.no_grad():
        lin.weight.mul_(2)
    with torch.inference_mode():
        after = ops.tile_linear(x, weights.tiles(lin, ops.pack_tiles), None)
    assert torch.equal(after, (2 * before.float()).to(torch.bfloat16))  # x2 is exact in binary floating point


@needs_tiles
def test_the_engine_multiplies_on_tiles_in_bf16_only():
    for dtype, tiles in ((torch.bfloat16, True), (torch.float32, False)):
        model = tiny_decoder("llama-d64", dtype)
        c = model.cfg
        cache = KVCache(c.num_layers, 2, 32, c.num_kv_heads, c.head_dim, dtype, "cpu")
        backend = ModelRunner(model, cache).backend
        assert isinstance(backend, CpuBackend) and backend.tiles == tiles
        assert backend.layout == (TILES if tiles else ONEDNN)


@needs_tiles
def test_bench_matmul_times_both_kernels_and_compares_their_outputs(capsys):
    from rhymerl.bench import matmul_bench
    from tiny_models import tiny_checkpoint

    summary = matmul_bench.run(tiny_checkpoint("llama")[0], rows=(1, 17), repeats=1)
    assert summary["matmuls_per_forward"] == 4 * 2 + 1 and list(summary["rows"]) == ["1", "17"]
    for r in summary["rows"].values():
        assert r["onednn_ms"] > 0 and r["tiles_ms"] > 0
        assert r["max_rel_diff"] < 2e-2  # the same products, summed in another order, rounded once to bf16
    matmul_bench.print_table(summary)
    assert "tiles ms" in capsys.readouterr().out


def test_a_build_lock_left_by_a_killed_build_is_removed_once_stale(tmp_path):
    """torch's cpp_extension waits forever on the `lock` file of a build that was killed; one older than
    STALE_LOCK_S is removed (with a warning), a fresh one (a build running now) is left alone."""
    lock = tmp_path / "lock"
    lock.touch()
    made = lock.stat().st_mtime
    assert not native.clear_stale_lock(tmp_path, now=made + 10) and lock.exists()
    with pytest.warns(UserWarning, match="build lock"):
        assert native.clear_stale_lock(tmp_path, now=made + native.STALE_LOCK_S + 1)
    assert not lock.exists() and not native.clear_stale_lock(tmp_path)
