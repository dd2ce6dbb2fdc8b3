"""One rank of `dtrain train`: `python -m dtrain.train.worker CONFIG.json` (started for you)."""

from __future__ import annotations

import json
import sys

from dtrain.errors import DtrainError
from dtrain.train.config import config_from_dict
from dtrain.train.trainer import train


def main(argv: list[str]) -> int:
    try:
        with open(argv[0], encoding="utf-8") as f:
            train(config_from_dict(json.load(f)))
    except DtrainError as exc:
        print(f"dtrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
