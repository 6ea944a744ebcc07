"""`rhymerl bench engine`: our engine vs transformers `generate` on the same model, prompts and sampling.

Tokens/s counts generated tokens up to and including EOS (or the length limit). transformers generates a
batch of `b` prompts at a time, left-padded, until its longest response ends: that is how a CPU user of
TRL without vLLM rolls out. Our engine runs the same prompts through `b` slots with continuous batching.
"""

from __future__ import annotations

import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from rhymerl.bench.console import device_fields, table_console
from rhymerl.bench.progress import Progress
from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.errors import UserError
from rhymerl.model.pretrained import chat_prompt_ids, default_device, load_pretrained, parse_dtype, resolve_dtype
from rhymerl.tasks.arithmetic import make_problems, prompt_text

DEFAULT_PROMPTS = {1: 8, 8: 32, 32: 128}  # 4 requests per slot at 8 and 32, as in an RL rollout (prompts x generations >> slots)


def hf_generate(hf_model, prompts: list[list[int]], batch: int, params: SamplingParams, pad_id: int,
                eos_ids: list[int]) -> tuple[int, float]:
    """(generated tokens, seconds) for transformers `generate` over `prompts` in batches of `batch`."""
    total, t0 = 0, time.perf_counter()
    torch.manual_seed(params.seed)
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=hf_model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=hf_model.device)
        sampling = dict(do_sample=True, temperature=params.temperature, top_k=0, top_p=params.top_p) \
            if not params.greedy else dict(do_sample=False)
        with torch.inference_mode():
            out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=params.max_tokens,
                                    pad_token_id=pad_id, eos_token_id=eos_ids, **sampling)
        for row in out[:, width:].tolist():
            ends = [j for j, t in enumerate(row) if t in eos_ids]
            total += ends[0] + 1 if ends else len(row)
    return total, time.perf_counter() - t0


def ours_generate(model, tokenizer, prompts, batch: int, params: SamplingParams, max_model_len: int) -> tuple[int, float, Engine]:
    engine = Engine(model, tokenizer, num_slots=batch, max_model_len=max_model_len)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t0, engine


def run(model_name: str = "smollm2-135m", dtype: str = "auto", batches=(1, 8, 32), num_prompts: int | None = None,
        max_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
        skip_hf: bool = False, device: str | None = None) -> dict:
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    except ValueError as e:  # its range checks, naming the field: before the model loads
        raise UserError(f"bench engine: {e} (--temperature, --top-p, --max-tokens)") from None
    dtype = resolve_dtype(dtype, device or default_device())  # the JSON names what ran
    progress = Progress("engine", 2 + (not skip_hf) + len(batches) * (1 + (not skip_hf)))
    progress.stage(f"loading {model_name} ({dtype})")
    model, tokenizer, model_dir = load_pretrained(model_name, dtype, device)
    device = next(model.parameters()).device
    if not skip_hf:
        progress.stage("loading the transformers model")
    hf_model = None if skip_hf else \
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=parse_dtype(dtype)).to(device).eval()
    eos_ids = sorted(Engine(model, tokenizer, num_slots=1, max_model_len=8).eos_token_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    problems = make_problems(max(max(DEFAULT_PROMPTS.values()), num_prompts or 0), seed=seed)
    all_prompts = [chat_prompt_ids(tokenizer, prompt_text(p)) for p in problems]
    max_model_len = max(map(len, all_prompts)) + max_tokens
    # Warm both sides up once (first calls pay for allocator and kernel set-up).
    progress.stage("warm-up")
    warm = all_prompts[:2]
    ours_generate(model, tokenizer, warm, 2, SamplingParams(temperature=0, max_tokens=8), max_model_len)
    if hf_model is not None:
        hf_generate(hf_model, warm, 2, SamplingParams(temperature=0, max_tokens=8), pad_id, eos_ids)
    results = {}
    for b in batches:
        prompts = all_prompts[: num_prompts or DEFAULT_PROMPTS.get(b, 4 * b)]
        progress.stage(f"batch {b}: our engine, {len(prompts)} prompts")
        tok, sec, engine = ours_generate(model, tokenizer, prompts, b, params, max_model_len)
        row = {"prompts": len(prompts), "ours_tokens": tok, "ours_s": round(sec, 2), "ours_tok_s": round(tok / sec, 1),
               "ours_forwards": engine.stats.forward_passes}
        if hf_model is not None:
            progress.stage(f"batch {b}: transformers generate, {len(prompts)} prompts")
            htok, hsec = hf_generate(hf_model, prompts, b, params, pad_id, eos_ids)
            row.update(hf_tokens=htok, hf_s=round(hsec, 2), hf_tok_s=round(htok / hsec, 1),
                       speedup=round((tok / sec) / (htok / hsec), 2))
        results[str(b)] = row
    progress.done()
    return {"model": model_name, "dtype": dtype, **device_fields(device),
            "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "batches": results}


def print_table(summary: dict, console: Console | None = None) -> None:
    console = console or table_console()
    t = Table(title=f"rollout throughput: {summary['model']} {summary['dtype']}, T={summary['temperature']}, "
                    f"max_tokens={summary['max_tokens']}, {summary.get('gpu') or str(summary['threads']) + ' threads'}")
    for col in ("batch", "prompts", "ours tok", "ours s", "ours tok/s", "hf tok", "hf s", "hf tok/s", "speedup"):
        t.add_column(col, justify="right")
    for b, r in summary["batches"].items():
        t.add_row(b, str(r["prompts"]), str(r["ours_tokens"]), str(r["ours_s"]), str(r["ours_tok_s"]),
                  str(r.get("hf_tokens", "-")), str(r.get("hf_s", "-")), str(r.get("hf_tok_s", "-")),
                  f"{r['speedup']}x" if "speedup" in r else "-")
    console.print(t)
