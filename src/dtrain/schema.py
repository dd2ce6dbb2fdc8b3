"""How a config section says what it accepts: the rules every section of `dtrain train`'s
config follows, so that each component defines its own section beside its code.

A section is a dataclass. Each field has a type, a default and a docstring under it (the
docs' config reference is checked against them); a choice is a `Literal[...]` type; a
bound is field metadata:

    @dataclass
    class CommConfig:
        backend: Literal["auto", "gloo", "nccl", "shm"] = "auto"
        \"\"\"Collective backend ...\"\"\"
        bucket_mb: float = positive(25.0)
        \"\"\"Gradient bucket size ...\"\"\"

        def check(self) -> None:          # optional: rules between its own fields
            ...

`coerce` checks a value read from TOML against a field's type as it is set; `check_fields`
checks a whole section's choices and bounds, then its own `check()`; the messages name
the key as the user writes it (`comm.bucket_mb = -1 must be positive`).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Bound = Literal["positive", "non_negative"]
T = TypeVar("T")

_BOUND_WORDS = {"positive": "must be positive", "non_negative": "must not be negative"}


def positive(default: T) -> T:
    """A field whose value must be above 0 (a count, a size, a rate)."""
    return dataclasses.field(default=default, metadata={"bound": "positive"})


def non_negative(default: T) -> T:
    """A field whose value must be 0 or more (0 often meaning "off" or "infer")."""
    return dataclasses.field(default=default, metadata={"bound": "non_negative"})


def choices(kind: object) -> tuple[object, ...] | None:
    """The values a `Literal[...]` type allows (None for any other type)."""
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else None


def _type_name(kind: object) -> str:
    return getattr(kind, "__name__", str(kind))


def coerce(key: str, value: object, kind: object) -> object:
    """`value` (as TOML gave it) for a field of type `kind`: an int where a float goes
    becomes one; lists and tables are checked item by item. A choice's type is its
    values' (which of them is checked later, by `check_fields`).

    Raises:
        ConfigError: the value is of the wrong type, or a float that is not finite.
    """
    allowed = choices(kind)
    if allowed is not None:
        kind = type(allowed[0])
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} = {value!r} must be a finite number")
    origin = typing.get_origin(kind)
    if origin is dict:
        key_kind, value_kind = typing.get_args(kind)
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r} must be a table, e.g. {{\"pattern\" = "
                              "\"colwise\"}")
        return {coerce(f"{key}.{k}", k, key_kind): coerce(f"{key}.{k}", v, value_kind)
                for k, v in value.items()}
    if origin is list:
        (item,) = typing.get_args(kind)
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r} must be a list")
        return [coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if not isinstance(kind, type):
        raise TypeError(f"{key}: a field of type {kind!r} cannot be read from TOML")
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{key} = {value!r} must be {_type_name(kind)}, not "
                          f"{type(value).__name__}")
    return value


def hints(section: type) -> dict[str, Any]:
    """Each field's type, by name, as the section's module declares it."""
    return typing.get_type_hints(section)


def check_fields(section: DataclassInstance, name: str) -> None:
    """Check `section` (the dataclass of `[name]`): every choice is one of its `Literal`'s
    values, every bound holds, then the section's own `check()` if it has one.

    Raises:
        ConfigError: the first value that does not fit, named `name.key`.
    """
    kinds = hints(type(section))
    for f in dataclasses.fields(section):
        key, value = f"{name}.{f.name}", getattr(section, f.name)
        allowed = choices(kinds[f.name])
        if allowed is not None and value not in allowed:
            raise ConfigError(f"{key} = {value!r} must be one of "
                              f"{', '.join(map(str, allowed))}")
        bound = f.metadata.get("bound")
        if (bound == "positive" and value <= 0) or (bound == "non_negative" and value < 0):
            raise ConfigError(f"{key} = {value!r} {_BOUND_WORDS[bound]}")
    own = getattr(section, "check", None)
    if own is not None:
        own()
