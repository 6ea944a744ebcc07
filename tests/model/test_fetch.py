"""Model resolution: offline error paths, local dirs, and the real cached model."""

from __future__ import annotations

import json

import pytest

from rhymerl.model import fetch
from rhymerl.model.fetch import ModelNotFoundError, resolve_model_dir


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """Point the cache at a temp dir so test inputs never land in the real cache."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(fetch, "CACHE_DIR", cache)
    return cache


def test_unknown_plain_name_lists_what_was_tried(tmp_cache):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_dir("no-such-model")
    msg = str(err.value)
    assert "'no-such-model'" in msg
    assert "not a built-in name (known: smollm2-135m)" in msg
    assert "no file or directory " in msg and "no-such-model;" in msg
    assert "not a hub id" in msg


def test_hub_like_id_reports_download_failure(tmp_cache, monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kwargs):
        raise OSError(f"offline, cannot fetch {repo_id}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_dir("some-org/some-model")
    msg = str(err.value)
    assert "'some-org/some-model'" in msg
    assert "not a built-in name" in msg
    assert "hub download failed: OSError: offline, cannot fetch some-org/some-model" in msg


def test_local_hf_dir_is_returned_as_is(tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
                                                       "intermediate_size": 8, "num_hidden_layers": 1,
                                                       "num_attention_heads": 2}))
    assert resolve_model_dir(str(model_dir)) == model_dir


def test_dir_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model_dir(str(tmp_path))


def test_unreadable_gguf_names_the_file(tmp_path, tmp_cache):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_dir(str(bad))
    assert str(bad) in str(err.value)
    assert not list(tmp_cache.glob("models/*")), "nothing half-written may remain"


@pytest.mark.real_model
def test_smollm2_loads_in_transformers(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (smollm2_dir / ".complete").is_file()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.config.eos_token_id == tok.eos_token_id
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
