"""HistoSpec on the real model (issue 26, item 3): smollm2-135m in fp32, history from a first plain epoch,
speculative decoding token-identical to plain decoding, with drafts accepted."""

import torch
from transformers import AutoTokenizer

from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.history import HistoryStore
from rhymerl.model.pretrained import chat_prompt_ids
from rhymerl.model.weights import load_decoder
from helpers import speculator

QUESTIONS = ("What is 3 + 4?", "Name a color.", "Count from 1 to 10.")


def test_histospec_on_smollm2_is_token_identical_to_plain(smollm2_dir):
    """T=0.7 (keyed draws, so the identity covers sampling, not only argmax), 3 prompts x 2 generations,
    24 tokens; the history: one plain epoch with another seed."""
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = load_decoder(smollm2_dir, torch.float32)
    prompts = [chat_prompt_ids(tok, q) for q in QUESTIONS]

    def engine(spec, history=None):
        return Engine(model, tok, num_slots=6, max_model_len=256, 
                      speculator=speculator(spec, history))

    params = SamplingParams(temperature=0.7, max_tokens=24, seed=3)
    history = HistoryStore()  # a first epoch: plain decoding, other seeds
    first = engine("off").generate(prompts * 2, SamplingParams(**{**params.__dict__, "seed": 103}))
    for i, p in enumerate(prompts):
        history.record_rollout(p, [first[i].token_ids, first[i + len(prompts)].token_ids], [1.0, 1.0])
    ids = [f"q{i}-g{g}" for g in range(2) for i in range(len(prompts))]  # 2 generations per prompt
    plain = engine("off").generate(prompts * 2, params, request_ids=ids)
    spec_engine = engine("histospec", history)
    spec = spec_engine.generate(prompts * 2, params, request_ids=ids)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.text for o in spec] == [o.text for o in plain]
    for a, b in zip(spec, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)
    stats = spec_engine.speculator.stats
    assert stats.drafted > 0 and stats.accepted > 0
    assert any(o.tokens_per_forward > 1 for o in spec)  # some request committed several tokens a forward
