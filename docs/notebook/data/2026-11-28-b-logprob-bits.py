"""Are smollm2-135m fp32 rollout log-probs bit-identical across drafting and batch composition?"""
import sys; sys.path.insert(0, "tests")  # run from the repository root
import torch
from pathlib import Path
from transformers import AutoTokenizer
from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.history import HistoryStore
from rhymerl.model.pretrained import chat_prompt_ids
from rhymerl.model.weights import load_decoder
from rhymerl.tasks.repeat import make_texts, prompt_text
from helpers import speculator
torch.set_num_threads(1)
d = Path.home() / ".cache/rhymerl/models/smollm2-135m"
tok = AutoTokenizer.from_pretrained(d)
model = load_decoder(d, torch.float32)
prompts = [chat_prompt_ids(tok, prompt_text(t)) for t in make_texts(4, 0)]
def engine(spec, history=None, slots=8):
    return Engine(model, tok, num_slots=slots, max_model_len=512, speculator=speculator(spec, history))
params = SamplingParams(temperature=0.6, max_tokens=96, seed=3)
history = HistoryStore()
first = engine("off").generate(prompts * 2, SamplingParams(**{**params.__dict__, "seed": 103}))
for i, p in enumerate(prompts):
    history.record_rollout(p, [first[i].token_ids, first[i + len(prompts)].token_ids], [1.0, 1.0])
ids = [f"q{i}-g{g}" for g in range(2) for i in range(len(prompts))]
runs = {"plain8": engine("off").generate(prompts * 2, params, request_ids=ids),
        "plain3": engine("off", slots=3).generate(prompts * 2, params, request_ids=ids),
        "spec8": engine("histospec", history).generate(prompts * 2, params, request_ids=ids)}
base = runs["plain8"]
n = sum(len(o.logprobs) for o in base)
for k, outs in runs.items():
    same = [o.token_ids for o in outs] == [o.token_ids for o in base]
    diff = sum(a != b for x, y in zip(outs, base) for a, b in zip(x.logprobs, y.logprobs))
    mx = max(abs(a - b) for x, y in zip(outs, base) for a, b in zip(x.logprobs, y.logprobs))
    print(k, "tokens same", same, "logprobs differing", diff, "/", n, "max", mx, flush=True)
