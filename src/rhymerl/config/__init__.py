"""The typed config of `rhymerl train`: OmegaConf structured configs over dataclass sections.

A config is built in three layers, later ones winning (verl's convention):

1. the dataclass defaults, which are the schema (they run the embedded arithmetic job on smollm2-135m);
2. an optional YAML file, a mapping of sections (``rollout: {temperature: 0.6}``);
3. command-line overrides ``section.field=value`` (an OmegaConf dotlist), applied in order.

OmegaConf merges each layer into the schema, converting and type-checking every value; `OmegaConf.to_object`
then gives plain dataclasses, and `validate` has each section check its own ranges and choices. All failures
raise `ConfigError` with a message that names the key (and the file).

The parts, each importing only those before it:

- `fields`: the field machinery: a field with its help, choices and range (`option`), the per-field checks,
  `ConfigError`;
- `sections`: the dataclass sections (help text, choices and ranges in the field metadata, per-section
  `validate`), `TrainConfig`, the choice lists;
- `loading`: YAML and override layers merged on OmegaConf, its errors translated, did-you-mean for unknown keys;
- `help`: `config_help`, the key reference of `rhymerl train --help`.

No torch here: the CLI must be able to print `--help` and reject a bad config instantly.
"""

from __future__ import annotations

from rhymerl.config.help import config_help
from rhymerl.config.loading import config_from_dict, config_to_dict, load_config, save_config
from rhymerl.config.sections import (
    ADMISSION_ORDERS,
    BUILTIN_TASKS,
    DRAFT_RULES,
    DTYPES,
    LOSS_TYPES,
    LR_SCHEDULERS,
    ROLLOUT_BACKENDS,
    SCALE_REWARDS,
    SPECULATIVE_MODES,
    ConfigError,
    DataSection,
    ModelSection,
    RaySection,
    RewardSection,
    RolloutSection,
    RunSection,
    TrainConfig,
    TrainSection,
    ValSection,
    validate,
)

__all__ = [
    "ADMISSION_ORDERS", "BUILTIN_TASKS", "DRAFT_RULES", "DTYPES", "LOSS_TYPES", "LR_SCHEDULERS", "ROLLOUT_BACKENDS",
    "SCALE_REWARDS", "SPECULATIVE_MODES", "ConfigError", "DataSection", "ModelSection", "RaySection",
    "RewardSection", "RolloutSection", "RunSection", "TrainConfig", "TrainSection", "ValSection", "config_from_dict",
    "config_help", "config_to_dict", "load_config", "save_config", "validate",
]
