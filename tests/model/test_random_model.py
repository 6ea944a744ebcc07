"""Random-weight built-ins: a tiny shape built through resolve_model_dir into a temp cache, read alike by our
loader and transformers; the real Qwen2.5-1.5B entry checked from its config alone (no 3 GB write)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rhymerl.model import fetch, random_model
from rhymerl.model.config import ModelConfig
from rhymerl.model.fetch import ModelNotFoundError, resolve_model_dir
from rhymerl.model.random_model import RANDOM_MODELS, parameter_count, write_random_model_dir
from rhymerl.model.weights import load_decoder

# The 1.5B entry's architecture at a size that builds in well under a second; the vocabulary stays large
# enough for smollm2's token ids (< 49152).
TINY = {**RANDOM_MODELS["qwen2.5-1.5b-random"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 49152}


@pytest.fixture
def tiny_cache(tmp_path, monkeypatch):
    """A temp cache that knows the tiny shape as a random built-in."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(fetch, "CACHE_DIR", cache)
    monkeypatch.setitem(RANDOM_MODELS, "tiny-random", TINY)
    return cache


@pytest.fixture
def donor_dir(tmp_path):
    """A stand-in for the tokenizer's model dir (config.json only) where the tokenizer itself is not needed."""
    d = tmp_path / "donor"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**TINY, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}))
    return d


def _hf_tensors(model_dir):
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("shard_bytes", [None, 1 << 20], ids=["one-file", "sharded"])
def test_tiny_random_model_reads_the_same_in_rhymerl_and_transformers(tiny_cache, smollm2_dir, monkeypatch,
                                                                      shard_bytes):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # The tokenizer donor from the real cache (a path resolves as it is), never a download into tmp.
    monkeypatch.setattr(fetch, "RANDOM_TOKENIZER", str(smollm2_dir))
    if shard_bytes is not None:
        monkeypatch.setattr(random_model, "MAX_SHARD_BYTES", shard_bytes)
    d = resolve_model_dir("tiny-random")

    assert d == tiny_cache / "models" / "tiny-random" and (d / ".complete").is_file()
    assert not list(d.parent.glob("*.tmp-*"))
    assert (d / "model.safetensors.index.json").is_file() == (shard_bytes is not None)
    assert len(list(d.glob("*.safetensors"))) == (1 if shard_bytes is None else 2)
    assert "lm_head.weight" not in _hf_tensors(d)  # tied to the embedding
    assert all(t.dtype == torch.bfloat16 for t in _hf_tensors(d).values())
    assert AutoConfig.from_pretrained(d).model_type == "qwen2"
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 2

    tok = AutoTokenizer.from_pretrained(d)
    assert tok.eos_token_id == 2
    ids = torch.tensor([tok("The capital of France is").input_ids])
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours = load_decoder(d, torch.float32)
    with torch.no_grad():
        expected = ref(ids).logits
        torch.testing.assert_close(ours(ids), expected, atol=1e-4, rtol=1e-4)
    assert expected.std() > 0.05  # logits of random weights, not zeros that would match anything


def test_second_resolve_reuses_the_cache(tiny_cache, donor_dir, monkeypatch):
    monkeypatch.setattr(fetch, "RANDOM_TOKENIZER", str(donor_dir))
    first = resolve_model_dir("tiny-random")

    def rebuild(*args, **kwargs):
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(fetch, "write_random_model_dir", rebuild)
    assert resolve_model_dir("tiny-random") == first


def test_a_crash_midway_leaves_nothing_that_looks_complete(tiny_cache, donor_dir, monkeypatch):
    monkeypatch.setattr(fetch, "RANDOM_TOKENIZER", str(donor_dir))

    def crash(config, out, tokenizer_dir):
        (out / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(fetch, "write_random_model_dir", crash)
    with pytest.raises(OSError, match="disk full"):
        resolve_model_dir("tiny-random")
    assert not list((tiny_cache / "models").iterdir())


def test_weights_are_reproducible_and_independent_of_sharding(tmp_path, donor_dir):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_random_model_dir(TINY, a, donor_dir)
    write_random_model_dir(TINY, b, donor_dir, max_shard_bytes=1 << 20)
    ta, tb = _hf_tensors(a), _hf_tensors(b)
    assert set(ta) == set(tb)
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    emb = ta["model.embed_tokens.weight"].float()
    assert abs(emb.std().item() - 0.02) < 1e-3
    assert torch.equal(ta["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert not ta["model.layers.0.self_attn.q_proj.bias"].any()


def test_qwen2_5_1_5b_entry_has_the_real_shape(tmp_path):
    from transformers import AutoConfig

    config = RANDOM_MODELS["qwen2.5-1.5b-random"]
    cfg = ModelConfig.from_hf_dict(config)
    assert (cfg.model_type, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == ("qwen2", 1536, 8960, 28)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (12, 2, 128, 151936)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e6, 1e-6, 32768)
    assert cfg.tie_word_embeddings and cfg.qkv_bias and not cfg.qk_norm
    # Qwen2.5-1.5B's published size: 1.54B parameters with the (tied) embedding.
    assert parameter_count(config) == 1_543_714_304
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "Qwen2Config" and hf.num_key_value_heads == 2 and hf.tie_word_embeddings


def test_unknown_name_lists_the_random_builtins(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "CACHE_DIR", tmp_path)
    with pytest.raises(ModelNotFoundError, match="qwen2.5-1.5b-random"):
        resolve_model_dir("no-such-model")
