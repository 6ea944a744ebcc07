"""The `rhymerl train` config: defaults, YAML + override precedence, coercion, validation messages, round trip."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from rhymerl.config import (
    ConfigError,
    ModelSection,
    RolloutSection,
    TrainConfig,
    TrainSection,
    config_from_dict,
    config_help,
    config_to_dict,
    load_config,
    save_config,
    validate,
)


def write(tmp_path, text: str, name: str = "config.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------- defaults and precedence


def test_defaults_validate_and_match_the_embedded_job():
    cfg = load_config()
    validate(cfg)
    assert cfg == TrainConfig()
    assert cfg.model.name == "smollm2-135m" and cfg.data.task == "arithmetic"
    assert cfg.rollout.num_generations == 8 and cfg.train.loss_type == "dapo"


def test_yaml_then_overrides_in_order(tmp_path):
    path = write(tmp_path, "rollout:\n  temperature: 0.6\n  top_k: 20\ntrain:\n  total_steps: 5\n")
    cfg = load_config(path, ["rollout.temperature=0.8", "train.total_steps=7", "train.total_steps=9"])
    assert cfg.rollout.temperature == 0.8  # override beats file
    assert cfg.rollout.top_k == 20  # file beats default
    assert cfg.train.total_steps == 9  # later override wins
    assert cfg.rollout.top_p == 1.0  # untouched default


def test_empty_yaml_file_and_empty_section_keep_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == TrainConfig()
    assert load_config(write(tmp_path, "rollout:\n", "b.yaml")) == TrainConfig()


# ---------------------------------------------------------------- type coercion


def test_str_fields_stay_strings():
    cfg = load_config(overrides=["model.name=123", "run.output_dir=true", "data.train_files=1e-5"])
    assert cfg.model.name == "123" and cfg.run.output_dir == "true" and cfg.data.train_files == "1e-5"


def test_str_override_quotes_and_empty_value():
    cfg = load_config(overrides=["model.name='my model'", "data.val_files=", "reward.function=pkg.mod:score"])
    assert cfg.model.name == "my model" and cfg.data.val_files == "" and cfg.reward.function == "pkg.mod:score"


def test_str_field_from_yaml_number(tmp_path):
    assert load_config(write(tmp_path, "model:\n  name: 123\n")).model.name == "123"


@pytest.mark.parametrize("text, expected", [("true", True), ("false", False), ("True", True), ("FALSE", False)])
def test_bool_parsing(text, expected):
    assert load_config(overrides=[f"run.wandb={text}"]).run.wandb is expected


def test_float_accepts_int_and_exponent_without_dot():
    # YAML 1.1 reads '1e-5' as a string; a learning rate must still accept it.
    cfg = load_config(overrides=["train.learning_rate=1e-5", "rollout.temperature=1", "train.beta=2.5e-2"])
    assert cfg.train.learning_rate == 1e-5 and cfg.train.beta == 0.025
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)


@pytest.mark.parametrize("override, message", [
    ("train.learning_rate=abc", "train.learning_rate: expected float, got 'abc'"),
    ("train.total_steps=1.5", "train.total_steps: expected int, got 1.5"),
    ("train.total_steps=true", "train.total_steps: expected int, got True"),
    ("run.wandb=1", "run.wandb: expected bool"),
    ("rollout.temperature=.nan", "rollout.temperature: must be a finite number"),
])
def test_bad_types_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert message in str(e.value)


@pytest.mark.parametrize("text, message", [
    ("run:\n  wandb: 1\n", "run.wandb: expected bool (true/false), got 1"),
    ("run:\n  wandb: 'yes'\n", "run.wandb: expected bool (true/false), got 'yes'"),
    ("run:\n  output_dir: true\n", "run.output_dir: expected str, got True"),
    ("train:\n  learning_rate: true\n", "train.learning_rate: expected float, got True"),
])
def test_true_false_only_for_bool_fields_in_yaml(tmp_path, text, message):
    with pytest.raises(ConfigError, match="config.yaml: " + message.replace("(", r"\(").replace(")", r"\)")):
        load_config(write(tmp_path, text))


def test_bad_type_in_yaml_names_file_and_key(tmp_path):
    path = write(tmp_path, "train:\n  learning_rate: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"config\.yaml: train\.learning_rate: expected float"):
        load_config(path)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("override, message", [
    ("rollout.temperature=-1", "rollout.temperature: must be >= 0, got -1.0"),
    ("rollout.top_p=0", "rollout.top_p: must be in (0, 1], got 0.0"),
    ("rollout.num_generations=1", "rollout.num_generations: must be >= 2, got 1"),
    ("rollout.speculative=eagle", "rollout.speculative: must be one of 'histospec', 'off', got 'eagle'"),
    ("rollout.dtype=fp16", "rollout.dtype: must be one of"),
    ("train.dtype=fp16", "train.dtype: must be one of"),
    ("rollout.draft_rule=x", "rollout.draft_rule: must be one of"),
    ("train.lr_scheduler=step", "train.lr_scheduler: must be one of"),
    ("train.loss_type=ppo", "train.loss_type: must be one of"),
    ("train.scale_rewards=std", "train.scale_rewards: must be one of"),
    ("data.task=gsm8k", "data.task: must be one of"),
    ("train.learning_rate=0", "train.learning_rate: must be > 0, got 0.0"),
    ("train.epsilon_high=0.1", "train.epsilon_high: must be >= train.epsilon (0.2), got 0.1"),
    ("train.micro_batch_size=0", "train.micro_batch_size: must be >= 1"),
    ("train.max_grad_norm=-1", "train.max_grad_norm: must be >= 0"),
    ("model.lora_dropout=1", "model.lora_dropout: must be in [0, 1)"),
    ("run.keep_checkpoints=0", "run.keep_checkpoints: must be >= 1"),
    ("val.every=-1", "val.every: must be >= 0"),
    ("reward.function=myreward", "reward.function: must be 'module:function'"),
])
def test_validation_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert message in str(e.value)


def test_zero_means_off_where_documented():
    cfg = load_config(overrides=["train.max_grad_norm=0", "val.every=0", "run.save_every=0", "rollout.top_k=0",
                                 "rollout.temperature=0", "model.lora_r=0", "data.num_val_prompts=0"])
    assert cfg.train.max_grad_norm == 0.0 and cfg.val.every == 0


def test_validate_reports_every_error_at_once():
    cfg = dataclasses.replace(TrainConfig(), rollout=RolloutSection(temperature=-1.0, top_p=2.0))
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert "rollout.temperature" in str(e.value) and "rollout.top_p" in str(e.value)


def test_each_section_validates_itself():
    for f in dataclasses.fields(TrainConfig):
        assert getattr(TrainConfig(), f.name).validate() == []  # defaults are valid
    assert RolloutSection(top_p=2.0, draft_rule="x").validate() == [  # in field order
        "rollout.top_p: must be in (0, 1], got 2.0",
        "rollout.draft_rule: must be one of 'aimd', 'doubling', 'cost', got 'x'"]
    assert TrainSection(epsilon=0.3, epsilon_high=0.25).validate() == [
        "train.epsilon_high: must be >= train.epsilon (0.3), got 0.25"]
    assert ModelSection(name=" ").validate() == ["model.name: must be non-empty, got ' '"]


def test_validate_collects_errors_across_sections():
    cfg = dataclasses.replace(TrainConfig(), model=ModelSection(lora_r=-1),
                              rollout=RolloutSection(num_generations=1), train=TrainSection(learning_rate=0.0))
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    lines = str(e.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["model.lora_r", "rollout.num_generations", "train.learning_rate"]


@pytest.mark.parametrize("override, ok", [
    ("rollout.top_p=1", True), ("rollout.top_p=1e-9", True), ("rollout.top_p=1.01", False),
    ("model.lora_dropout=0", True), ("model.lora_dropout=0.999", True), ("train.adam_beta2=1", False),
    ("model.lora_alpha=1", True), ("model.lora_alpha=0", False), ("rollout.num_slots=0", False),
    ("train.epsilon_high=0.2", True),
])
def test_range_bounds_are_inclusive_where_written(override, ok):
    if ok:
        load_config(overrides=[override])
    else:
        with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.") + ": must be"):
            load_config(overrides=[override])


def test_the_result_is_plain_dataclasses():
    cfg = load_config(overrides=["rollout.temperature=0.6"])
    assert type(cfg) is TrainConfig and type(cfg.rollout) is RolloutSection and type(cfg.train) is TrainSection
    assert dataclasses.replace(cfg.rollout, temperature=0.7).temperature == 0.7


def test_yaml_file_numbers_strings_and_exponents(tmp_path):
    path = write(tmp_path, "train:\n  learning_rate: 1e-5\nmodel:\n  name: 1e-5\nrollout:\n  temperature: 1\n")
    cfg = load_config(path)
    assert cfg.train.learning_rate == 1e-5 and cfg.model.name == "1e-5"
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)


def test_interpolation_errors_name_the_key(monkeypatch):
    monkeypatch.setenv("RHYMERL_TEST_TEMPERATURE", "0.25")
    assert load_config(overrides=["rollout.temperature=${oc.env:RHYMERL_TEST_TEMPERATURE}"]).rollout.temperature \
        == 0.25
    with pytest.raises(ConfigError, match=r"^rollout\.temperature: .*RHYMERL_TEST_NOT_SET"):
        load_config(overrides=["rollout.temperature=${oc.env:RHYMERL_TEST_NOT_SET}"])


def test_validate_catches_wrong_types_set_in_code():
    cfg = dataclasses.replace(TrainConfig(), rollout=RolloutSection(num_slots="32"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"rollout\.num_slots: expected int, got '32'"):
        validate(cfg)


# ---------------------------------------------------------------- unknown keys and malformed input


def test_unknown_key_suggests_the_closest():
    msg = r"unknown key 'rollout\.temprature' \(did you mean 'rollout\.temperature'\?\)"
    with pytest.raises(ConfigError, match=msg):
        load_config(overrides=["rollout.temprature=0.5"])


def test_bare_field_name_suggests_its_sections():
    with pytest.raises(ConfigError, match=r"did you mean 'rollout\.temperature' or 'val\.temperature'"):
        load_config(overrides=["temperature=0.5"])


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = write(tmp_path, "train:\n  learnig_rate: 0.1\n")
    msg = r"config\.yaml: unknown key 'train\.learnig_rate' \(did you mean 'train\.learning_rate'"
    with pytest.raises(ConfigError, match=msg):
        load_config(path)


def test_unknown_section_in_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.yaml: unknown section 'rollot' \(did you mean 'rollout'\?\)"):
        load_config(write(tmp_path, "rollot:\n  temperature: 0.5\n"))


def test_dotted_key_in_yaml_explains_nesting(tmp_path):
    with pytest.raises(ConfigError, match=r"nested by section"):
        load_config(write(tmp_path, "rollout.temperature: 0.5\n"))


@pytest.mark.parametrize("override", ["foo", "=3", "rollout.temperature"])
def test_bad_override_syntax(override):
    with pytest.raises(ConfigError, match=rf"override '{override}' is not key=value"):
        load_config(overrides=[override])


def test_yaml_section_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.yaml: section 'rollout' must be a mapping"):
        load_config(write(tmp_path, "rollout: 0.5\n"))


def test_yaml_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.yaml: top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_invalid_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.yaml: not valid YAML"):
        load_config(write(tmp_path, "rollout: {temperature: 0.5\n"))
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read config file"):
        load_config(tmp_path / "nope.yaml")


# ---------------------------------------------------------------- round trip and help


def test_save_load_round_trip(tmp_path):
    cfg = load_config(overrides=["model.name=123", "train.learning_rate=3e-6", "run.wandb=true",
                                 "data.train_files=data/train.parquet", "reward.function=rw.py:score"])
    path = tmp_path / "run" / "config.yaml"
    path.parent.mkdir()
    save_config(cfg, path)
    assert load_config(path) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg
    # sections are written in declaration order
    text = path.read_text()
    assert [line.rstrip(":") for line in text.splitlines() if not line.startswith(" ")] == \
        ["model", "data", "reward", "rollout", "train", "val", "run", "ray"]


def test_config_from_dict_fills_missing_keys_and_rejects_unknown():
    assert config_from_dict({"train": {"total_steps": 3}}).train.total_steps == 3
    with pytest.raises(ConfigError, match=r"resume\.yaml: unknown key 'train\.old_key'"):
        config_from_dict({"train": {"old_key": 1}}, source="resume.yaml")


def test_help_lists_every_key_with_default():
    text = config_help()
    for section, body in config_to_dict(TrainConfig()).items():
        assert f"{section}:" in text
        for name in body:
            assert f"{section}.{name} " in text
    assert "rollout.temperature" in text and "float = 1.0" in text
    assert "[histospec | off]" in text


def test_module_does_not_import_torch():
    code = "import sys, rhymerl.config; assert 'torch' not in sys.modules, 'config imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
