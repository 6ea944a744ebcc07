"""Our decoder against transformers on the same weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rhymerl.model.weights import load_decoder, to_hf_state_dict
from tiny_models import ARCHS, VOCAB, tiny_checkpoint, tiny_decoder


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers(arch):
    _, ref = tiny_checkpoint(arch)
    ours = tiny_decoder(arch)
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_left_padding_matches_unpadded(arch):
    ours = tiny_decoder(arch)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 9)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(ours(padded, mask)[:, 4:], ours(ids), atol=1e-5, rtol=1e-5)


def test_bf16_close_to_transformers():
    path, _ = tiny_checkpoint("qwen2")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ours = load_decoder(path, torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).float(), ref(ids).logits.float(), atol=0.05, rtol=0.05)


def test_trains_under_autograd():
    ours = tiny_decoder("qwen3")
    ours.train()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    logits = ours(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = [p.grad for p in ours.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert ours.layers[0].self_attn.qkv_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hf_state_dict_round_trip(arch):
    _, ref = tiny_checkpoint(arch)
    ours = tiny_decoder(arch)
    exported = to_hf_state_dict(ours)
    expected = {k: v for k, v in ref.state_dict().items() if not (k == "lm_head.weight" and ours.cfg.tie_word_embeddings)}
    assert set(exported) == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(exported[k], v, atol=0, rtol=0)


def test_real_model_matches_transformers(smollm2_dir):
    ref = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ours = load_decoder(smollm2_dir, torch.float32)
    ids = torch.tensor([[1, 504, 3458, 282, 1789, 314, 253, 1073, 30, 2]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)


def test_branch_attention_runs_in_fp32_under_cpu_autocast():
    """Under bf16 autocast SDPA would run in bf16, whose CPU backward is ~3x slower than fp32's at the update's
    shapes (notebook 2026-11-28-d): the branch attention keeps fp32 there, the same values as without autocast."""
    from rhymerl.model.decoder import BranchAttention

    torch.manual_seed(0)
    heads, kv_heads, dim, n = 6, 2, 16, 11  # one prompt of 5 tokens, two branches of 3
    gather = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 8, 9, 10]])
    scatter = torch.tensor(list(range(8)) + [8 + 5, 8 + 6, 8 + 7])
    attention = BranchAttention(gather, scatter)
    q = torch.randn(n, heads, dim, requires_grad=True)
    kv = torch.randn(n, 2 * kv_heads, dim, requires_grad=True)
    plain = attention.attend(None, q, kv)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = attention.attend(None, q, kv)
    assert cast.dtype == torch.float32 and torch.equal(cast, plain)
    cast.sum().backward()  # the backward runs too, in fp32
    assert q.grad.dtype == torch.float32 and kv.grad.dtype == torch.float32


def test_the_dense_attention_runs_in_fp32_under_cpu_autocast():
    from rhymerl.model.decoder import CausalAttention

    torch.manual_seed(0)
    b, s, heads, kv_heads, dim = 2, 5, 6, 2, 16
    q, kv = torch.randn(b * s, heads, dim), torch.randn(b * s, 2 * kv_heads, dim)
    for mask in (None, torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])):
        attention = CausalAttention(b, s, mask)
        plain = attention.attend(None, q, kv)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = attention.attend(None, q, kv)
        assert cast.dtype == torch.float32 and torch.equal(cast, plain)
