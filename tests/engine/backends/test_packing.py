"""The eager backend's prepacked oneDNN weights (`cpu_weights.prepacked_linears`) give the plain result, are
remade when the weights change, and leave the model plain outside the backend's forward."""

import pytest
import torch

from rhymerl.engine.backends import EagerBackend
from rhymerl.engine.backends.cpu_weights import cpu_packing_supported, model_weights, prepacked_linears
from rhymerl.engine.kv_cache import KVCache
from tiny_models import VOCAB, tiny_decoder

pytestmark = pytest.mark.skipif(not cpu_packing_supported(torch.zeros(1, dtype=torch.bfloat16)),
                                reason="this CPU has no oneDNN bf16 support")


def test_packed_forward_equals_plain_and_tracks_updates():
    model = tiny_decoder("qwen2", torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(ids)
    assert model_weights(model).packable()
    with torch.inference_mode(), prepacked_linears(model):
        packed = model(ids)
    torch.testing.assert_close(packed, plain, atol=0.02, rtol=0.02)
    # An in-place update (what an optimizer step does) must reach the packed path on the next call.
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(-5.0)
    with torch.inference_mode(), prepacked_linears(model):
        after = model(ids)
    with torch.inference_mode():
        expected = model(ids)  # outside the block: the plain path, as the reference
    torch.testing.assert_close(after, expected, atol=0.02, rtol=0.02)
    assert not torch.allclose(after, packed, atol=0.02, rtol=0.02)  # the update did reach the output
    assert all("forward" not in m.__dict__ for m in model.modules())  # the model is plain again


def test_training_path_ignores_packing():
    model = tiny_decoder("llama", torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    with prepacked_linears(model):
        model(ids).float().sum().backward()
    assert model.layers[1].self_attn.qkv_proj.weight.grad is not None


def test_packed_fp32_path_matches_plain():
    """In fp32 the prepacked path differs from the plain one only by summation order."""
    model = tiny_decoder("qwen3", torch.float32)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        plain = model(ids)
        assert model_weights(model).packable()
        with prepacked_linears(model):
            packed = model(ids)
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_eager_backend_multiplies_by_prepacked_weights_on_a_cpu(dtype):
    model = tiny_decoder("llama", dtype)
    c = model.cfg
    cache = KVCache(c.num_layers, 2, 32, c.num_kv_heads, c.head_dim, dtype, "cpu")
    assert EagerBackend(model, cache).prepacked
