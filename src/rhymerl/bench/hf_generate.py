"""transformers `generate` as `bench engine`'s baseline, in three modes:

- `eager`: plain `generate` (a dynamic KV cache that grows by concatenation), what TRL calls without vLLM.
- `static`: a static KV cache (`StaticCache`, what `cache_implementation="static"` builds), preallocated to a
  fixed length, with transformers' automatic compilation turned off (`disable_compile=True`): on CUDA,
  transformers 5 compiles the forward by itself whenever the cache is static, which would make this mode the
  same as `compiled`.
- `compiled`: the static cache plus transformers' own compilation of the decoding forward (`compile_config`,
  the documented way in transformers 5: `generate` wraps `model.__call__` in `torch.compile` with the
  `CompileConfig`'s arguments, inductor + "reduce-overhead", i.e. CUDA graphs on a GPU; prefill stays eager).
  transformers compiles only on accelerators unless the config says `_compile_all_devices`, which a CPU run
  sets so that the mode means the same thing everywhere.

The static modes keep one `StaticCache` per model and batch size, sized to the same `max_cache_len` (the
longest prompt plus max_tokens) and reset before each call: the documented way to reuse a static cache across
`generate` calls (`cache=`, then `StaticCache.reset`). Left to itself, `generate` would build a new cache per
call; its tensors are marked as static addresses for CUDA graphs, so new ones mean a re-recorded graph per call.
A new batch size is a new cache shape, hence a recompilation, which `warm_up` pays for outside the timing.
"""

from __future__ import annotations

import time
import weakref

import torch
from transformers import CompileConfig, StaticCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation import utils as generation_utils

from rhymerl.engine.sampling_params import SamplingParams

HF_MODES = ("eager", "static", "compiled")
# `generate`'s name for a cache handed in: `cache` in recent transformers, `past_key_values` before (5.17 has
# only that one); the first of the names the installed version accepts
_CACHE_KWARG = getattr(generation_utils, "ALL_CACHE_NAMES", ["past_key_values"])[0]
_CACHES: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()  # model -> {shape: cache}


def parse_hf_modes(text: str, skip_hf: bool = False) -> list[str]:
    """`--hf-modes`'s comma-separated subset of HF_MODES, in the order given (none with `--skip-hf`)."""
    if skip_hf:
        return []
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in HF_MODES]
    if unknown or not modes:
        raise ValueError(f"--hf-modes: {', '.join(unknown) or 'empty'}: choose from {', '.join(HF_MODES)}")
    return list(dict.fromkeys(modes))


def mode_keys(mode: str) -> tuple[str, str]:
    """(key prefix, speedup key) of a mode's figures in a bench row: eager keeps the names it had before the
    other modes existed (`hf_tok_s`, `speedup`), so that older figures stay comparable."""
    return ("hf", "speedup") if mode == "eager" else (f"hf_{mode}", f"speedup_vs_{mode}")


class _StopAfter(StoppingCriteria):
    """Stops every row once `new` tokens are generated past `width` (warm-ups: a short run at the real cache
    shape). A class of its own: `generate` refuses a custom criterion of a type it already builds itself."""

    def __init__(self, width: int, new: int):
        self.length = width + new

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, device=input_ids.device)


def _mode_kwargs(hf_model, mode: str, batch: int, max_cache_len: int) -> dict:
    """`generate`'s arguments for `mode` at `batch` rows: the static modes' reset cache, and whether to compile."""
    if mode == "eager":
        return {}
    caches = _CACHES.setdefault(hf_model, {})
    cache = caches.get((batch, max_cache_len))
    if cache is None:
        cache = caches[batch, max_cache_len] = StaticCache(config=hf_model.config, max_cache_len=max_cache_len)
    cache.reset()  # zeroes in place: the addresses stay
    if mode == "static":
        return {_CACHE_KWARG: cache, "disable_compile": True}
    config = CompileConfig()  # transformers' defaults: inductor, "reduce-overhead" (CUDA graphs), not fullgraph
    if hf_model.device.type != "cuda":
        config._compile_all_devices = True
    return {_CACHE_KWARG: cache, "compile_config": config}


def hf_generate(hf_model, prompts: list[list[int]], batch: int, params: SamplingParams, pad_id: int,
                eos_ids: list[int], mode: str = "eager", max_cache_len: int | None = None,
                stop_after: int | None = None) -> tuple[int, float]:
    """(generated tokens, seconds) for transformers `generate` in `mode` over `prompts` in batches of `batch`,
    left-padded, each batch until its longest response ends; tokens count up to and including EOS.
    `stop_after` ends each batch after that many tokens (warm-ups)."""
    total, t0 = 0, time.perf_counter()
    torch.manual_seed(params.seed)
    device = hf_model.device
    if mode != "eager" and not max_cache_len:
        raise ValueError(f"transformers {mode}: a static cache needs max_cache_len")
    sampling = dict(do_sample=True, temperature=params.temperature, top_k=0, top_p=params.top_p) \
        if not params.greedy else dict(do_sample=False)
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        stop = StoppingCriteriaList([_StopAfter(width, stop_after)]) if stop_after else None
        with torch.inference_mode():
            out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=params.max_tokens,
                                    pad_token_id=pad_id, eos_token_id=eos_ids, stopping_criteria=stop,
                                    **sampling, **_mode_kwargs(hf_model, mode, len(chunk), max_cache_len))
        for row in out[:, width:].tolist():
            ends = [j for j, t in enumerate(row) if t in eos_ids]
            total += ends[0] + 1 if ends else len(row)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return total, time.perf_counter() - t0


def warm_up(hf_model, prompts: list[list[int]], batch: int, params: SamplingParams, pad_id: int,
            eos_ids: list[int], mode: str, max_cache_len: int) -> None:
    """Untimed: run `mode` at each batch shape that the timed run over `prompts` will meet (`batch`, and a
    smaller last batch if the prompts don't divide evenly), a few tokens each, at the timed run's cache length.
    The compiled mode compiles (and captures CUDA graphs) per batch shape, and that must not be timed; the
    static mode allocates its caches here too."""
    sizes = {batch, len(prompts) % batch or batch}
    for size in sorted(sizes):
        # 8 decode steps: dynamo compiles on the first; CUDA graph trees record on a later call, not the first.
        hf_generate(hf_model, prompts[:size], size, params, pad_id, eos_ids, mode, max_cache_len, stop_after=8)


def error_text(e: BaseException) -> str:
    """A failed mode's entry in its row: the exception's type and first line, short enough for a table."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:200]
