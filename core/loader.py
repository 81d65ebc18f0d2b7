"""Building config dataclasses from flags and ``SPECGATE_*`` variables, in one place.

Precedence, highest first: an explicit CLI flag (or request field), then the
``SPECGATE_<FIELD>`` environment variable (field name upper-cased, e.g.
``SPECGATE_MASS=0.9``, ``SPECGATE_TARGET=/m/t.gguf``), then the field's default.
Nested config dataclasses are named flat (``mass``, not ``selection.mass``).
Validation failures are :class:`ConfigError`, never ``assert``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, TypeVar

from core.errors import ConfigError


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    require(value in choices, f"{name} must be one of {choices}, got {value!r}")


def field_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def flat_fields(cls: type) -> list[dataclasses.Field]:
    """The settable fields of ``cls``, with nested config dataclasses expanded: flags,
    ``SPECGATE_*`` variables and request objects name them flat (``mass``, not
    ``selection.mass``); field names are unique across the nesting."""
    out: list[dataclasses.Field] = []
    for f in dataclasses.fields(cls):
        default = field_default(f)
        out.extend(flat_fields(type(default)) if dataclasses.is_dataclass(default) else [f])
    return out


T = TypeVar("T")


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def convert_value(name: str, raw: Any, default: Any) -> Any:
    if isinstance(raw, str) and not isinstance(default, str):
        try:
            if isinstance(default, bool):
                return parse_bool(raw)
            if isinstance(default, int):
                return int(raw)
            if isinstance(default, float):
                return float(raw)
            if isinstance(default, tuple):
                return tuple(s for s in raw.split(",") if s)
        except ValueError:
            raise ConfigError(f"{name}: cannot read {raw!r} as {type(default).__name__}") from None
    return raw


def build(cls: type[T], flags: Mapping[str, Any] | None = None,
          env: Mapping[str, str] | None = None) -> T:
    """Build ``cls`` from flags (non-None wins), then SPECGATE_* env, then defaults."""
    flags = flags or {}
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        default = field_default(f)
        if dataclasses.is_dataclass(default):
            values[f.name] = build(type(default), flags, env)
        elif flags.get(f.name) is not None:
            values[f.name] = convert_value(f"--{f.name.replace('_', '-')}", flags[f.name], default)
        elif (key := f"SPECGATE_{f.name.upper()}") in env:
            values[f.name] = convert_value(key, env[key], default)
    return cls(**values)


def override(base: T, **changes: Any) -> T:
    """A copy of ``base`` with the non-None ``changes`` (flat names, see :func:`flat_fields`)
    applied and validated; an unknown name is a :class:`ConfigError`."""
    real = {k: v for k, v in changes.items() if v is not None}
    if not real:
        return base
    for f in dataclasses.fields(base):  # type: ignore[arg-type]
        inner = getattr(base, f.name)
        if dataclasses.is_dataclass(inner):
            names = {g.name for g in flat_fields(type(inner))}
            mine = {k: real.pop(k) for k in list(real) if k in names}
            if mine:
                real[f.name] = override(inner, **mine)
    known = {f.name for f in dataclasses.fields(base)}  # type: ignore[arg-type]
    if unknown := set(real) - known:
        raise ConfigError(f"unknown field(s) {sorted(unknown)} for {type(base).__name__}")
    return dataclasses.replace(base, **real)  # type: ignore[type-var]
