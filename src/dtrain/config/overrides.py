"""The command line's side of the config: a TOML file and `--set section.key=value`."""

from __future__ import annotations

import argparse
import tomllib
from typing import Any

from dtrain.errors import ConfigError


def add_config_arguments(parser: argparse.ArgumentParser, config_help: str,
                         example: str = "train.steps=50") -> None:
    """The options of every command that reads a training config: an optional TOML file
    and repeatable `--set section.key=value` overrides (into `overrides`)."""
    parser.add_argument("config", nargs="?", help=config_help)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help=f"override a config key, e.g. {example}")


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split `section.key=value`; the value is read as TOML, falling back to a string.

    Raises:
        ConfigError: `text` is not of that form.
    """
    key, sep, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not section or not name:
        raise ConfigError(f"--set {text!r} is not section.key=value (e.g. train.steps=50)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, name, value
