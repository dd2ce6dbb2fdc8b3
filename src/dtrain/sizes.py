"""Sizes in bytes as people write them: `64K`, `16M`, `80GB`, `24GiB`.

One parser for every flag and key that takes a size. A bare letter is binary, as in the
collectives' message sizes (`16M` = 16 MiB), the `iB` forms are binary too, and the `B`
forms are decimal, as memory and disk sizes are sold (`80GB` = 80e9 bytes).
"""

from __future__ import annotations

import re

from dtrain.errors import ConfigError

UNITS = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgt", start=1):
    UNITS[_letter] = UNITS[f"{_letter}ib"] = 1 << 10 * _power
    UNITS[f"{_letter}b"] = 1000**_power

_SIZE = re.compile(r"\s*([0-9]+\.?[0-9]*|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str, flag: str = "size") -> int:
    """The bytes in `text`: a number with an optional unit (B; K, M, G, T and KiB .. TiB in
    powers of 1024; KB .. TB in powers of 1000).

    Raises:
        ConfigError: `text` is not such a size, is not a whole number of bytes, or is 0;
            the message names `flag`.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if unit not in UNITS:
        raise ConfigError(f"{flag} {text!r} is not a size in bytes: give a size like 80GB, "
                          "24GiB, 64K or 16M (K, M, G = KiB, MiB, GiB)")
    assert match is not None  # else unit is None, refused above
    size = float(match.group(1)) * UNITS[unit]
    if size != int(size):
        raise ConfigError(f"{flag} {text!r} is not a size in bytes: not a whole number of "
                          "bytes")
    if size <= 0:
        raise ConfigError(f"{flag} {text!r} must be more than 0: not a size in bytes")
    return int(size)
