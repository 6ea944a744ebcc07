"""What a stream share's weight load costs a rollout worker (`histopipe/stream_fleet.py`'s `load_s`): the work
`WorkerActor.stream_rollout` does before a share of another version than the one it holds, measured on a real
`RolloutWorker` (plain decoding) of MODEL in each DTYPE.

A load is `_from_store` (views over the object store's arrays, no copy), `RolloutWorker.load_weights` (an
in-place copy of every parameter), and, at the next forward, the CPU backend remaking its weight copies
(`cpu_weights.ModelWeights.copy`: they notice the new weights by the parameter's version counter). So a load's
price is: the `load_weights` call, plus how much longer a short rollout takes right after a load than without
one (both timed, alternating, `--runs` times each; medians). The object store's fetch is not timed (one node:
shared memory, read in place).

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/weight_load_cost.py [--model smollm2-135m] [--dtypes fp32,bf16]

Prints one JSON object per dtype on stdout ({"dtype", "threads", "params", "load_weights_s", "repack_s",
"load_s", each run's seconds}); progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from rhymerl.config import RolloutSection
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.history import HistoryStore
from rhymerl.model.pretrained import load_pretrained, parse_dtype
from rhymerl.rollout.ray_actor import _from_store, to_store
from rhymerl.rollout.types import RolloutGroup
from rhymerl.rollout.worker import RolloutWorker, WorkerConfig


def measure(model: str, dtype: str, runs: int, tokens: int) -> dict:
    policy, tokenizer, _ = load_pretrained(model, "fp32", "cpu")
    config = WorkerConfig(RolloutSection(dtype=dtype, speculative="off", num_slots=4), max_model_len=64 + tokens)
    worker = RolloutWorker(policy, tokenizer, config)
    params = dict(policy.named_parameters())
    # two versions in the store's form, as `RayStream.publish` puts them (the second a nudged copy: new values)
    stores = [to_store(params, parse_dtype(dtype)),
              to_store({k: v.detach() * (1 + 1e-3) for k, v in params.items()}, parse_dtype(dtype))]
    prompt = tokenizer.encode("Write a short rhyme about the sea.")
    empty = HistoryStore().export([])
    sp = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=0)

    def rollout(version: int) -> float:
        t = time.perf_counter()
        worker.rollout([RolloutGroup(prompt, [f"r{i}" for i in range(4)])], sp, empty, version)
        return time.perf_counter() - t

    rollout(0)  # warm-up: the backend's copies, the kernels
    loads, after, plain = [], [], []
    version = 0
    for i in range(runs):
        plain.append(rollout(version))
        version += 1
        t = time.perf_counter()
        worker.load_weights(_from_store(stores[version % 2], parse_dtype(dtype)), version)
        loads.append(time.perf_counter() - t)
        after.append(rollout(version))
        print(f"{dtype} run {i + 1}/{runs}: load_weights {loads[-1]:.4f} s, rollout after a load {after[-1]:.4f} s, "
              f"without {plain[-1]:.4f} s", file=sys.stderr)
    load, repack = statistics.median(loads), statistics.median(after) - statistics.median(plain)
    return {"model": model, "dtype": dtype, "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in params.values()), "runs": runs, "rollout_tokens": tokens,
            "load_weights_s": load, "repack_s": repack, "load_s": load + max(repack, 0.0),
            "load_weights_runs": loads, "rollout_after_load_runs": after, "rollout_plain_runs": plain}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=8, help="tokens each timed rollout decodes per request")
    args = ap.parse_args()
    for dtype in args.dtypes.split(","):
        print(json.dumps(measure(args.model, dtype, args.runs, args.tokens)))


if __name__ == "__main__":
    main()
