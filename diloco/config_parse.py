"""Reading a RunConfig from TOML, JSON and --set assignments: types checked, unknown keys refused.
Kept apart from the config's dataclasses (diloco.config), which say what the keys are."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration that cannot be used: unknown key, wrong type, impossible value."""


# The model factory's keys that used to live in [model] itself: named in the refusal of such a key.
_FACTORY_KEYS = ("n_layer", "n_head", "n_embd", "dropout")


def build(cls: type, data: dict[str, Any], where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"config section {where or 'top level'} must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(unknown_key(f"{prefix}{unknown[0]}"))
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        f = fields[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        path = f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(default):
            kwargs[name] = build(type(default), value, path)
        elif isinstance(default, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {path!r} expects a table, got {value!r}")
            kwargs[name] = dict(value)
        elif isinstance(default, list):
            kwargs[name] = _names(value, path)
        else:
            kwargs[name] = _coerce(value, type(default), path)
    return cls(**kwargs)


def unknown_key(dotted: str) -> str:
    section, _, leaf = dotted.rpartition(".")
    if section == "model" and leaf in _FACTORY_KEYS:
        return f"unknown config key {dotted!r}: the model's own settings are model.kwargs.{leaf}"
    elsewhere = keys_named(leaf)
    if elsewhere:  # a key put in the wrong section (train.quorum): name where it lives
        return f"unknown config key {dotted!r}: did you mean {' or '.join(elsewhere)}?"
    return f"unknown config key {dotted!r}"


def keys_named(leaf: str) -> list[str]:
    """The run config's dotted keys whose last part is `leaf` ("quorum" -> ["sync.quorum"])."""
    # Imported here: diloco.config imports this module, and says what the keys are.
    from diloco.config import RunConfig

    return sorted(k for k in flatten(RunConfig().to_dict()) if k.rpartition(".")[2] == leaf)


# Free-form tables: keys of the user's choosing, values kept as TOML gives them.
_TABLES = ("model.kwargs",)


def is_table(parents: list[str]) -> bool:
    return ".".join(parents) in _TABLES


def literal(value: Any) -> Any:
    """A --set value for a free-form table: a TOML literal (2, 0.5, true, "x", [1, 2]) when it
    reads as one, else the string itself."""
    if not isinstance(value, str):
        return value
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def read_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and f"{prefix}{key}" not in _TABLES:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def parse_assignments(items: list[str]) -> dict[str, str]:
    """`section.key=value` strings (from --set) into overrides; values are coerced later."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _names(value: Any, path: str) -> list[str]:
    """A list of names: a TOML array of strings, or "a,b,c" (from --set)."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(f"config key {path!r} expects a list of names, got {value!r}")


def _coerce(value: Any, kind: type, path: str) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
    elif kind is int and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
    elif kind is float and not isinstance(value, bool):
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str and isinstance(value, str):
        return value
    raise ConfigError(f"config key {path!r} expects {kind.__name__}, got {value!r}")


def toml_value(value: Any) -> str:
    if isinstance(value, dict):  # an inline table: model.kwargs
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return repr(value)
