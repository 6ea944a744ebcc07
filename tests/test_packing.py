"""Prepacked bf16 weights give the plain result and are remade when the weights change."""

import pytest
import torch

from rhymerl.model.decoder import cpu_packing_supported
from tiny_models import VOCAB, tiny_decoder

pytestmark = pytest.mark.skipif(not cpu_packing_supported(torch.zeros(1, dtype=torch.bfloat16)),
                                reason="this CPU has no oneDNN bf16 support")


def test_packed_forward_equals_plain_and_tracks_updates():
    model = tiny_decoder("qwen2", torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(ids)
    assert model.enable_packing()
    with torch.inference_mode():
        packed = model(ids)
    torch.testing.assert_close(packed, plain, atol=0.02, rtol=0.02)
    # An in-place update (what an optimizer step does) must reach the packed path on the next call.
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(-5.0)
    with torch.inference_mode():
        after = model(ids)
    model.layers[0].mlp.down_proj.packed = False  # plain path as the reference
    with torch.inference_mode():
        expected = model(ids)
    torch.testing.assert_close(after, expected, atol=0.02, rtol=0.02)
    assert not torch.allclose(after, packed, atol=0.02, rtol=0.02)  # the update did reach the output


def test_training_path_ignores_packing():
    model = tiny_decoder("llama", torch.bfloat16)
    model.enable_packing()
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    model(ids).float().sum().backward()
    assert model.layers[1].self_attn.qkv_proj.weight.grad is not None


def test_packed_fp32_path_matches_plain():
    """In fp32 the prepacked path differs from the plain one only by summation order."""
    model = tiny_decoder("qwen3", torch.float32)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        plain = model(ids)
        assert model.enable_packing()
        packed = model(ids)
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)
