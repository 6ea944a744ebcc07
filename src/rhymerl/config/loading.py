"""Building a `TrainConfig` in layers on OmegaConf: defaults <- YAML file <- `section.field=value` overrides.

OmegaConf merges each layer into the schema (`rhymerl.config.sections`), converting and type-checking every value;
`OmegaConf.to_object` then gives plain dataclasses, which `validate` checks. Layout and key names are checked here
before OmegaConf sees them, so that an unknown key gets a did-you-mean; every failure, OmegaConf's included,
raises `ConfigError` with one message naming the key (and the file).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from rhymerl.atomic_file import atomic_write
from rhymerl.config.sections import _ALL_KEYS, _TYPES, ConfigError, TrainConfig, validate

__all__ = ["config_from_dict", "config_to_dict", "load_config", "save_config"]


# ---------------------------------------------------------------- key lookups and merging


def _suggest(name: str, candidates: Sequence[str]) -> str:
    """' (did you mean ...?)' for the closest candidates, or ''."""
    # A bare field name ('temperature') is most likely meant as one of the keys ending in it.
    exact = [c for c in candidates if c.endswith("." + name)]
    close = exact or difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _type_of(key: str, where: str) -> type:
    """The type of field 'section.field'; `where` prefixes errors (a file name and ': ', or '')."""
    section, _, name = key.partition(".")
    if name not in _TYPES.get(section, {}):
        raise ConfigError(f"{where}unknown key {key!r}{_suggest(key, _ALL_KEYS)}")
    return _TYPES[section][name]


def _merge(conf: DictConfig, data: Any, where: str) -> DictConfig:
    """`conf` with the {section: {field: value}} mapping `data` merged in by OmegaConf (which converts and
    type-checks each value); the layout and key names are checked here first, for messages that suggest."""
    if data is None:  # an empty YAML file
        return conf
    if not isinstance(data, dict):
        raise ConfigError(f"{where}top level must be a mapping of sections ({', '.join(_TYPES)}), "
                          f"got {type(data).__name__}")
    for section, body in data.items():
        if section not in _TYPES:
            if isinstance(section, str) and section in _ALL_KEYS:
                s, _, f = section.partition(".")
                raise ConfigError(f"{where}keys are nested by section: write '{s}: {{{f}: ...}}', not {section!r}")
            raise ConfigError(f"{where}unknown section {section!r}{_suggest(str(section), list(_TYPES))}; "
                              f"sections are {', '.join(_TYPES)}")
        if body is not None and not isinstance(body, dict):
            raise ConfigError(f"{where}section {section!r} must be a mapping, got {type(body).__name__}")
        for name, value in (body or {}).items():
            key = f"{section}.{name}"
            # true/false only for a bool field, and only there: OmegaConf would take 1 or 'yes' as true, and
            # a true as the str 'True' or the float 1.0.
            typ = _type_of(key, where)
            if (typ is bool) != isinstance(value, bool):
                hint = " (true/false)" if typ is bool else ""
                raise ConfigError(f"{where}{key}: expected {typ.__name__}{hint}, got {value!r}")
    try:
        return typing.cast(DictConfig, OmegaConf.merge(conf, {s: b for s, b in data.items() if b is not None}))
    except OmegaConfBaseException as e:
        raise ConfigError(where + _message(e)) from None


def _message(e: OmegaConfBaseException) -> str:
    """An OmegaConf error as one line naming the key."""
    key = e.full_key or ""
    if isinstance(e, ValidationError) and key in _ALL_KEYS:  # a value OmegaConf cannot convert to the field's type
        return f"{key}: expected {_type_of(key, '').__name__}, got {e.value!r}"
    text = str(e.msg or e).splitlines()[0]  # OmegaConf appends full_key/object_type lines
    return f"{key}: {text}" if key else text


def _parse_overrides(overrides: Sequence[str]) -> dict[str, dict[str, Any]]:
    """`section.field=value` overrides as a nested mapping, values typed by OmegaConf's dotlist grammar."""
    data: dict[str, dict[str, Any]] = {}
    for text in overrides:
        key, sep, raw = text.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key:
            raise ConfigError(f"override {text!r} is not key=value (e.g. rollout.temperature=0.6)")
        section, _, name = key.partition(".")
        value: Any = raw
        if _type_of(key, "") is str:
            # A str field takes the text as typed ('model.name=123' is "123"); quotes are only stripped.
            if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
                value = raw[1:-1]
        else:
            try:
                parsed: Any = OmegaConf.to_container(OmegaConf.from_dotlist([f"{key}={raw}"]))
                value = parsed[section][name]
            except (yaml.YAMLError, OmegaConfBaseException):
                pass  # the merge rejects the raw text with the key in the message
        data.setdefault(section, {})[name] = value
    return data


def _finish(conf: DictConfig, where: str) -> TrainConfig:
    """The merged config as plain dataclasses, validated."""
    try:
        cfg = typing.cast(TrainConfig, OmegaConf.to_object(conf))
    except OmegaConfBaseException as e:  # e.g. an unresolvable ${...} interpolation
        raise ConfigError(where + _message(e)) from None
    validate(cfg)
    return cfg


# ---------------------------------------------------------------- public API


def config_to_dict(cfg: TrainConfig) -> dict[str, dict[str, Any]]:
    """The config as a nested plain dict, sections and fields in declaration order."""
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict[str, Any], source: str = "") -> TrainConfig:
    """A validated config from a nested dict (as written by `config_to_dict`); missing keys take defaults.

    `source` (e.g. a file name) prefixes error messages.
    """
    where = f"{source}: " if source else ""
    return _finish(_merge(OmegaConf.structured(TrainConfig), d, where), where)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Defaults <- YAML file at `path` (if given) <- `section.field=value` overrides in order; validated."""
    if isinstance(overrides, str):  # a lone string would be iterated character by character
        raise TypeError("load_config: overrides must be a sequence of 'key=value' strings, not a str")
    conf = OmegaConf.structured(TrainConfig)
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config file ({e.strerror or e})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save the YAML file as "
                              f"UTF-8") from None
        try:
            # PyYAML, not OmegaConf.load: a str field keeps '1e-5' as written; a float field converts it
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        conf = _merge(conf, data, f"{path}: ")
    return _finish(_merge(conf, _parse_overrides(overrides), ""), "")


def save_config(cfg: TrainConfig, path: str | Path, exclusive: bool = False) -> None:
    """Write `cfg` as YAML (sections in order) so that `load_config(path)` gives it back; atomically (a reader
    sees the whole file or none) and, with `exclusive`, only where no file is there yet (FileExistsError)."""
    with atomic_write(path, exclusive=exclusive) as f:
        f.write(yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False))
