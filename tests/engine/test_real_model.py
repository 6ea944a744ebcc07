"""The engine on the real model against transformers' own greedy generate."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.model.pretrained import chat_prompt_ids
from rhymerl.model.weights import load_decoder


def test_greedy_engine_equals_transformers_generate(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ours = load_decoder(smollm2_dir, torch.float32)
    prompts = [chat_prompt_ids(tok, q) for q in ("What is 3 + 4?", "Name a color.", "Hi")]
    engine = Engine(ours, tok, num_slots=2, max_model_len=256)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    eos = sorted(engine.eos_token_ids)  # the config's and the tokenizer's (transformers versions differ in which)
    for p, o in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0])[0, len(p):].tolist()
        assert o.token_ids == ref[: len(o.token_ids)] and len(o.token_ids) == len(ref)
