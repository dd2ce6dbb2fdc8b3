"""One rank of `dtrain train`: `python -m dtrain.train.worker CONFIG.json` (started for you)."""

from __future__ import annotations

import json
import sys

from dtrain.config import config_from_dict
from dtrain.errors import exit_code_of
from dtrain.train.trainer import train


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as f:
        config = json.load(f)
    return exit_code_of(lambda: train(config_from_dict(config)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
