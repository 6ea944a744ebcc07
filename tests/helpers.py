"""Helpers that tests in several folders share: a cost model under which drafting is free, a random model made
peaky enough for history drafts to be accepted, a recorded previous epoch, trainer samples, the engine's dense
reference (reference_generate, its keyed draw in plain Python). (A test file
imports them from here, never from another test file.)"""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch

from rhymerl.config import RolloutSection, TrainSection
from rhymerl.cost_model import CostModel
from rhymerl.engine.engine import Engine
from rhymerl.engine.sampler import BLOCK, filtered_probs, sample
from rhymerl.engine.sampling_params import SamplingParams, _splitmix64, draw_key, request_key
from rhymerl.histospec.speculator import Speculator
from rhymerl.histospec.verify import verify
from rhymerl.history import HistoryStore
from rhymerl.metrics import read_metrics
from rhymerl.rl.logprobs import Sample
from rhymerl.rl.ranks import RankFailure
from rhymerl.rl.trainer import PolicyTrainer
from rhymerl.rollout.worker import WorkerConfig
from tiny_models import VOCAB, random_prompts

FLAT = CostModel([1, 64], [1, 64], [[1.0, 1.0], [1.0, 1.0]])  # drafts are free: always draft


def peaky(model, scale=6.0):
    """A random model is nearly uniform, so its responses never repeat and no draft is ever accepted.
    Sharpening its output distribution (as training does to a policy) makes history predictive."""
    with torch.no_grad():
        model.norm.weight.mul_(scale)
    return model


def speculator(spec="histospec", history=None, cost=FLAT, max_draft_tokens=8, rule="cost", reward_aware=False):
    """What an engine takes for speculation mode `spec`: a HistoSpec `Speculator` drafting from `history`, or
    None for "off" (plain decoding). `cost` None: the engine measures one."""
    if spec == "off":
        return None
    return Speculator(cost, history, rule, max_draft_tokens, reward_weighted=reward_aware)


def worker_config(max_model_len: int = 64, **rollout) -> WorkerConfig:
    """A tiny test's `WorkerConfig`: the rollout section with the keys `rollout` gives (fp32 unless given: the
    section leaves the dtype to the machine) and a context of `max_model_len` tokens."""
    return WorkerConfig(RolloutSection(**{"dtype": "fp32", **rollout}), max_model_len)


def history_of(model, prompts, params, n_gen=3):
    """A previous 'epoch': n_gen responses per prompt with other seeds (plain decoding), recorded as history."""
    store = HistoryStore()
    for g in range(n_gen):
        p = SamplingParams(**{**params.__dict__, "seed": params.seed + 100 + g})
        plain = Engine(model, num_slots=4, max_model_len=96, eos_token_ids=[])
        for prompt, o in zip(prompts, plain.generate(prompts, p)):
            store.record_rollout(prompt, [o.token_ids], [1.0])
    return store


def training_samples(seed: int = 0, n: int = 6, group: int = 1) -> list[Sample]:
    """n trainer samples; with group > 1, consecutive runs of `group` samples share a prompt (GRPO siblings)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [p for p in random_prompts(n // group, seed=seed) for _ in range(group)]
    out = []
    for i, p in enumerate(prompts):
        k = int(torch.randint(1, 9, (1,), generator=g))
        comp = torch.randint(0, VOCAB, (k,), generator=g).tolist()
        old = (-torch.rand(k, generator=g) * 3 - 1).tolist()  # off-policy enough that clipping happens
        adv = 0.0 if i % 3 == 0 else float(torch.randn(1, generator=g))
        out.append(Sample(p, comp, old, adv))
    return out


def one_step_off_overrides(tiny_dir, out, reward: str, *extra: str, prompts: int = 4, micro_batch: int = 4) -> list[str]:
    """The config overrides of a tiny fp32 one_step_off run on 2 Ray workers (2 prompts x 3 a step, 8 tokens),
    scored by `reward`, a function of `tiny_dir`/reward_fns.py; `extra` last, so it wins."""
    return [f"model.name={tiny_dir}", f"run.output_dir={out}", f"data.num_train_prompts={prompts}",
            "data.num_val_prompts=0", "train.prompts_per_step=2", "rollout.num_generations=3",
            "rollout.max_completion_length=8", "rollout.num_slots=6", f"train.micro_batch_size={micro_batch}",
            "train.learning_rate=0.01", "train.dtype=fp32", "rollout.dtype=fp32", "run.progress=false",
            "run.tensorboard=false", "val.every=0", f"reward.function={tiny_dir / 'reward_fns.py'}:{reward}",
            "rollout.backend=ray", "rollout.num_workers=2", "rollout.mode=one_step_off", *extra]


def train_rows(run) -> list[dict]:
    """Run a `TrainingRun` to its end; its metrics rows after step 0. The run ends its pool's Ray actors
    itself (they hold the test cluster's 2 CPUs): checked here."""
    rows = [row for row in read_metrics(run.run()) if row["step"] > 0]
    assert getattr(run.pool, "actors", {}) == {}, "TrainingRun.run must end its Ray pool's actors"
    return rows


def learned(row: dict) -> dict:
    """What a step learned and rolled out, without its timings."""
    return {k: v for k, v in row.items() if k.startswith(("actor/", "critic/", "response_length/", "rollout/stal"))}


# ---- the update's ranks (tests/rl/test_ranks.py, test_ray_ranks.py, torchrun_ranks_script.py) ----
UPDATE_TEMPERATURE, UPDATE_MAX_LEN = 0.7, 8


def update_batches(n: int = 3) -> list:
    """Updates of 12 samples in groups of 3: with micro_batch_size 2, 5 micro-batches (an odd number, so one
    rank runs a padding micro-batch) of the 8 sequences with a non-zero advantage."""
    return [training_samples(seed=k, n=12, group=3) for k in range(n)]


def update_cfg(**kw) -> TrainSection:
    return TrainSection(**{"micro_batch_size": 2, "dtype": "fp32", "learning_rate": 1e-3, "total_steps": 4,
                           "lr_scheduler": "linear", "warmup_steps": 1,
                           "world_size": 2, **kw})


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def assert_metrics_close(a: dict, b: dict, what: str) -> None:
    """Every metric to 1e-5 relative (absolute below 1)."""
    assert a.keys() == b.keys(), what
    for k in a:
        assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), f"{what}: {k} {a[k]} vs {b[k]}"


def one_process_updates(model, cfg, batches, ref=None, state=None):
    trainer = PolicyTrainer(model, cfg, UPDATE_TEMPERATURE, UPDATE_MAX_LEN, ref_model=ref, dtype="fp32")
    if state is not None:
        trainer.load_state_dict(state)
    return trainer, [trainer.update(b) for b in batches]


def killed_rank_message(group, batch) -> str:
    """SIGKILL rank 1 of `group`, run an update: it must raise `RankFailure` with one line that says how to go
    on (--resume); returns that line. The caller closes the group."""
    os.kill(group.rank_pids()[1], signal.SIGKILL)
    with pytest.raises(RankFailure) as failure:
        group.update(batch)
    msg = str(failure.value)
    assert "\n" not in msg and "--resume" in msg, msg
    return msg


# ---- the engine's references: test_engine.py and test_cuda.py -------------------------------------
def keyed_uniform_reference(key: int, column: int) -> float:
    """`sampler.keyed_uniforms` for one (draw key, column) in plain Python uint64 arithmetic."""
    z = _splitmix64((key + column * 0x9E3779B97F4A7C15) & ((1 << 64) - 1))  # splitmix adds one more golden step
    return ((z >> 11) + 0.5) * (1.0 / (1 << 53))


def reference_sample(probs: list[float], key: int) -> int:
    """The two-level keyed Gumbel-max of `rhymerl.engine.sampler`, one draw, in plain Python."""
    def gumbel(column):
        return -math.log(-math.log(keyed_uniform_reference(key, column)))
    blocks = [probs[i : i + BLOCK] for i in range(0, len(probs), BLOCK)]
    scores = [math.log(sum(b)) + gumbel(j) if sum(b) > 0 else -math.inf for j, b in enumerate(blocks)]
    j = max(range(len(blocks)), key=lambda k: scores[k])
    inner = [math.log(p) + gumbel(j * BLOCK + i + (1 << 40)) if p > 0 else -math.inf for i, p in enumerate(blocks[j])]
    return j * BLOCK + max(range(len(inner)), key=lambda k: inner[k])


def reference_generate(model, prompt, params, request_id, eos=()):
    """Dense recomputation of the whole sequence at every token, sampling with the same keyed rule."""
    ids, logps = list(prompt), []
    for j in range(params.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0, -1].float()
        if params.greedy:
            tok = int(logits.argmax())
            logps.append(float(torch.log_softmax(logits, -1)[tok]))
        else:
            probs = filtered_probs(torch.softmax(logits[None] / params.temperature, -1), params)
            tok = reference_sample(probs[0].double().tolist(), draw_key(params.seed, request_key(request_id), j))
            logps.append(float(torch.log_softmax(logits / params.temperature, -1)[tok]))
        ids.append(tok)
        if tok in eos:
            break
    return ids[len(prompt):], logps


def host_walk(drafts, logits, starts, keys, offsets, params):
    """`histospec.verify` with the engine's draws: node n of sequence i at row starts[i] + n + 1."""
    def draw(live, nodes, depths):
        rows = [starts[i] + n + 1 for i, n in zip(live, nodes)]
        return sample(logits, params, [draw_key(params.seed, keys[i], offsets[i] + d) for i, d in zip(live, depths)],
                      rows=rows)
    return verify(drafts, draw)
