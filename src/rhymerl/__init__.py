"""rhymerl: RL training of LLMs whose rollout is made faster by history (HistoSpec, HistoPipe).

The public API, imported on first use (PEP 562), so that `import rhymerl` and the torch-free modules
(`rhymerl.history`, `rhymerl.cost_model`, `rhymerl.config`, `rhymerl.histospec`) do not load torch:

    from rhymerl import Engine, SamplingParams, HistoryStore, load_pretrained, chat_prompt_ids
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> module that defines it
_EXPORTS = {
    "Engine": "rhymerl.engine.engine",
    "RequestOutput": "rhymerl.engine.sequence",
    "SamplingParams": "rhymerl.engine.sampling_params",
    "HistoryStore": "rhymerl.history",
    "CostModel": "rhymerl.cost_model",
    "Speculator": "rhymerl.histospec.speculator",
    "load_pretrained": "rhymerl.model.pretrained",
    "chat_prompt_ids": "rhymerl.model.pretrained",
    "TrainConfig": "rhymerl.config",
    "load_config": "rhymerl.config",
    "TrainingRun": "rhymerl.rl.loop",
    "LocalPool": "rhymerl.rollout",
    "RolloutWorker": "rhymerl.rollout",
    "setup_process": "rhymerl.process",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rhymerl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
