"""Durations as operators write them (``30m``, ``2h``, ``1h30m``, ``off``).

Used by the ``[review]`` settings and ``leadgate notify sla``. Hand-written because it
is a dozen lines and the accepted forms are exactly what the README documents (no
ISO 8601 ``PT30M``, no bare numbers that could mean seconds or minutes).
"""

from __future__ import annotations

import re

from leadgate.core.errors import ValidationError, quoted

_UNITS_MS = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1_000}
_PART = re.compile(r"(\d+)([dhms])")
_WHOLE = re.compile(r"(?:\d+[dhms])+")
#: Words that switch a duration off.
OFF_WORDS = frozenset({"off", "none", "never", "0"})
#: The longest duration accepted (a year): a typo must not overflow a timestamp.
MAX_MS = 366 * _UNITS_MS["d"]


def parse_duration(value: str, *, name: str = "duration") -> int | None:
    """Milliseconds of ``value`` (``None`` for off), or a ValidationError naming ``name``.
    Accepts ``90s``, ``30m``, ``2h``, ``1d``, ``1h30m``; ``off``, and zero written in any
    unit (``0``, ``0s``, ``0m``), switch it off."""
    text = value.strip().lower()
    if text in OFF_WORDS or text == "":
        return None
    if not _WHOLE.fullmatch(text):
        raise ValidationError(
            f"{name} must be a duration such as 30m, 2h, 1d or 1h30m, or off (or 0) "
            f"(got {quoted(value)})",
            rule="duration.format",
        )
    total = sum(int(n) * _UNITS_MS[unit] for n, unit in _PART.findall(text))
    if total == 0:
        # `0` was off while `0s` was refused ("between 1s and 366d"): zero is zero.
        return None
    if total > MAX_MS:
        raise ValidationError(
            f"{name} must be between 1s and 366d, or off (or 0)", rule="duration.range"
        )
    return total


def format_duration(ms: int | None) -> str:
    """``5400000`` -> ``1h30m``; ``None`` -> ``off`` (the inverse of :func:`parse_duration`
    for whole seconds)."""
    if not ms:
        return "off"
    parts = []
    rest = ms // 1000 * 1000
    for unit, size in _UNITS_MS.items():
        count, rest = divmod(rest, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"
