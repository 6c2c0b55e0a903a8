"""Byte sizes from environment variables: ``DCN_CUPY_CPU_WORKSPACE_BYTES=64M`` and the like.

A size is a whole number of bytes (``67108864``) or a number with a binary unit: ``K``, ``M``,
``G``, ``T`` (powers of 1024), optionally followed by ``B`` or written ``KiB``/``MiB``/``GiB``/
``TiB``; case and blanks around the value do not matter (``512M``, ``2G``, ``64MiB``, ``1.5g``).
"""

from __future__ import annotations

import os
import re

__all__ = ["parse_size", "size_from_env", "format_size"]

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_ACCEPTS = "a positive number of bytes, optionally with a unit K, M, G or T (powers of 1024), e.g. 67108864, 512M, 2G, 64MiB"


def parse_size(text, name: str) -> int:
    """The number of bytes that ``text`` states; ``name`` (the variable) is quoted in errors.

    Raises:
        ValueError: ``text`` is not a size, or it is zero.
    """
    if isinstance(text, bool):
        raise TypeError(f"{name} must be a size in bytes, got bool {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text))
        if match is None:
            raise ValueError(f"{name} must be {_ACCEPTS}; got {text!r}")
        number, unit = match.groups()
        scale = _UNITS[unit.lower()]
        value = int(number) * scale if number.isdigit() else int(float(number) * scale)
    if value <= 0:
        raise ValueError(f"{name} must be {_ACCEPTS}; got {text!r}, which is not positive")
    return value


def size_from_env(name: str, default: int) -> int:
    """``parse_size`` of the environment variable ``name``, or ``default`` when it is unset or empty."""
    text = os.environ.get(name, "").strip()
    return parse_size(text, name) if text else default


def format_size(nbytes: int) -> str:
    """``nbytes`` for people: ``'64.0 MiB (67108864 bytes)'``."""
    if nbytes < 1024:
        return f"{nbytes} bytes"
    exponent = min(4, (int(nbytes).bit_length() - 1) // 10)
    unit = ("KiB", "MiB", "GiB", "TiB")[exponent - 1]
    return f"{nbytes / 1024 ** exponent:.1f} {unit} ({nbytes} bytes)"
