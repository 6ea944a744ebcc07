"""DAPO's settings as users write them: epsilon_high defaults to epsilon (TRL's default), and the README's DAPO
YAML example is a valid config that sets what it says."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import torch

from rhymerl.config import TrainSection, load_config
from rhymerl.rl.logprobs import Sample, token_logprobs
from rhymerl.rl.trainer import PolicyTrainer
from tiny_models import VOCAB, random_prompts, tiny_decoder

README = Path(__file__).resolve().parents[2] / "README.md"


def _update(model, epsilon_high: float) -> dict[str, torch.Tensor]:
    """The weights after one update whose ratios (new / old policy) are all 1.24: clipped by epsilon_high 0.2,
    not by 0.28."""
    model = copy.deepcopy(model).train()
    g = torch.Generator().manual_seed(0)
    samples = [Sample(p, torch.randint(0, VOCAB, (6,), generator=g).tolist(), [0.0] * 6, 1.0)
               for p in random_prompts(4, seed=2)]
    with torch.no_grad():
        logp, _, _ = token_logprobs(model, samples, 1.0, None)
    for b, s in enumerate(samples):
        s.logprobs[:] = (logp[b, :6] - math.log(1.24)).tolist()
    cfg = TrainSection(dtype="fp32", learning_rate=0.01, max_grad_norm=0.0, epsilon=0.2, epsilon_high=epsilon_high,
                       recompute_logprobs=False)  # the samples' old log-probs
    PolicyTrainer(model, cfg, temperature=1.0, max_completion_length=6).update(samples)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_epsilon_high_defaults_to_epsilon():
    assert TrainSection().epsilon_high == 0.0 and load_config().train.epsilon_high == 0.0  # 0 = epsilon
    model = tiny_decoder()
    default, same, higher = _update(model, 0.0), _update(model, 0.2), _update(model, 0.28)
    assert all(torch.equal(default[k], same[k]) for k in default)  # resolved to epsilon
    assert any(not torch.equal(default[k], higher[k]) for k in default)  # and 0.28 is another clip


def test_the_readmes_dapo_example_is_a_valid_config(tmp_path):
    blocks = re.findall(r"```yaml\n(# dapo.yaml\n.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1
    path = tmp_path / "dapo.yaml"
    path.write_text(blocks[0])
    cfg = load_config(path)
    assert (cfg.train.epsilon, cfg.train.epsilon_high, cfg.train.loss_type, cfg.train.beta) == (0.2, 0.28, "dapo", 0.0)
    assert cfg.train.filter_groups and cfg.train.max_num_gen_batches > 0
    assert 0 < cfg.reward.overlong_buffer_len < cfg.rollout.max_completion_length
    assert cfg.reward.overlong_penalty_factor == 1.0


@pytest.mark.parametrize("key", ["reward.functions", "reward.weights", "reward.timeout_s", "reward.overlong_buffer_len",
                                 "reward.overlong_penalty_factor", "train.filter_groups", "train.max_num_gen_batches",
                                 "rollout.reward_aware_drafting"])
def test_new_keys_are_in_the_readme_and_the_help(key):
    from rhymerl.config import config_help
    assert key.split(".")[1] in README.read_text()
    assert key in config_help()
