"""`rhymerl bench pipe`: what a long context costs a decode step, for the simulation (`ContextCost.per_key`).

The engine's cost model is measured at short contexts (`cost_model.measure`): it prices a step by its
shape, not by how far its sequences have got. Past a few hundred tokens a decode step's attention grows
with the keys each sequence attends to, and reasoning responses reach 16,384 tokens. So this times the
attention alone, as the engine runs it (`F.scaled_dot_product_attention`, one query per sequence, grouped
KV heads) on the model's shapes (layers, heads, KV heads, head dim), at `CONTEXTS` keys for a batch of
`seqs`, and fits seconds per key per sequence (least squares, through the measured points). Contexts past
the largest measured one are extrapolated linearly: attention's work is linear in its keys; the CPU's
caches make long contexts, if anything, dearer per key than the fit says. A causal prefill's attention (what
a migrated request re-runs) is timed the same way, one sequence at the same lengths, per (query, key) pair.
"""

from __future__ import annotations

import time

CONTEXTS = (512, 1024, 2048, 4096)
REPEATS = 3  # each point is the fastest of this many runs


def measure_per_key(model: str, dtype: str = "auto", device: str | None = None, seqs: int = 32,
                    contexts: tuple[int, ...] = CONTEXTS) -> dict:
    """{"per_key_s", "prefill_per_pair_s", "contexts", "seconds", "prefill_seconds", "seqs", "how"}: a decode
    step's attention seconds over all layers per key per sequence (`per_key_s`), from `seconds[i]` measured
    for `seqs` sequences at `contexts[i]` keys; a causal prefill's per (query, key) pair, from
    `prefill_seconds[i]` of one sequence of `contexts[i]` tokens."""
    import torch
    import torch.nn.functional as F

    from rhymerl.model.directory import check_model_dir
    from rhymerl.model.fetch import resolve_model_dir
    from rhymerl.model.pretrained import default_device, parse_dtype, resolve_dtype

    cfg = check_model_dir(resolve_model_dir(model))
    device = device or default_device()
    dt = parse_dtype(resolve_dtype(dtype, device), device)
    gqa = cfg.num_heads != cfg.num_kv_heads

    def timed(batch: int, queries: int, keys: int) -> float:  # all layers' seconds (one timed, all alike)
        q = torch.randn(batch, cfg.num_heads, queries, cfg.head_dim, dtype=dt, device=device)
        k = torch.randn(batch, cfg.num_kv_heads, keys, cfg.head_dim, dtype=dt, device=device)
        v = torch.randn_like(k)
        causal = queries > 1
        with torch.inference_mode():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)  # warm-up
            best = float("inf")
            for _ in range(REPEATS):
                if device != "cpu":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
                if device != "cpu":
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
        return best * cfg.num_layers

    seconds = [timed(seqs, 1, keys) for keys in contexts]
    prefill = [timed(1, n, n) for n in contexts]
    pairs = [n * (n + 1) / 2 for n in contexts]
    return {"per_key_s": _slope(contexts, seconds) / seqs, "prefill_per_pair_s": _slope(pairs, prefill),
            "contexts": list(contexts), "seconds": seconds, "prefill_seconds": prefill, "seqs": seqs,
            "how": f"SDPA of {model}'s shapes ({cfg.num_layers} layers, {cfg.num_heads} heads, "
                   f"{cfg.num_kv_heads} KV heads, head dim {cfg.head_dim}, {resolve_dtype(dtype, device)}), "
                   f"{seqs} sequences at {min(contexts)}-{max(contexts)} keys; extrapolated linearly past "
                   f"{max(contexts)}"}


def _slope(xs, ys) -> float:
    """The least-squares slope of ys on xs, at least 0."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs), 0.0)
