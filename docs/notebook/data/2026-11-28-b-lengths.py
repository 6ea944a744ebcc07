"""Per-group response lengths of bench pipe's real workload (repeat task, 12 x 8, T=0.6, 192 tokens, fp32),
epoch 1 (seed+1000, ids e1-*), epoch 2 (seed+2000, ids e2-*) and h2-h4 (seed+3000..5000), plain decoding (HistoSpec is lossless)."""
import json, sys, torch
from pathlib import Path
from transformers import AutoTokenizer
from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.model.weights import load_decoder
from rhymerl.bench.pipe_real import task_prompts
torch.set_num_threads(2)
d = Path.home() / ".cache/rhymerl/models/smollm2-135m"
tok = AutoTokenizer.from_pretrained(d)
model = load_decoder(d, torch.float32)
out = {}
for seed in map(int, sys.argv[1:]):
    prompts = task_prompts(tok, "repeat", 12, seed)
    eng = Engine(model, tok, num_slots=24, max_model_len=max(map(len, prompts)) + 193)
    for ep, off in (("e1", 1000), ("e2", 2000), ("h2", 3000), ("h3", 4000), ("h4", 5000)):
        ids = [f"{ep}-p{i}-g{g}" for i in range(12) for g in range(8)]
        batch = [p for p in prompts for _ in range(8)]
        res = eng.generate(batch, SamplingParams(temperature=0.6, max_tokens=192, seed=seed + off), request_ids=ids)
        lens = [len(o.token_ids) for o in res]
        out[f"{seed}-{ep}"] = [lens[i * 8:(i + 1) * 8] for i in range(12)]
        print(seed, ep, "total", sum(lens), "at cap", sum(l >= 192 for l in lens), flush=True)
        for i in range(12):
            print("  g", i, sorted(out[f"{seed}-{ep}"][i]), flush=True)
json.dump(out, open("2026-11-28-b-repeat-lengths.json", "w"))  # the saved file adds a "what" key
