"""Link rates and delays in tc's units: ``"100mbit"`` <-> 1e8 bits per second, ``"1ms"`` ->
0.001 s, and ``"fast"`` for an unshaped veth."""

from __future__ import annotations

import re

__all__ = ["FAST", "parse_latency", "parse_rate", "rate_label"]

_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)?\s*$", re.I)
_RATE_UNITS = {  # tc's units: "bit" suffixes are bits/s, "bps" suffixes bytes/s; k = 1000
    None: 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9,
}
_TIME_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|ms|us|usec|msec|sec)?\s*$", re.I)
_TIME_UNITS = {None: 1e-3, "s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}

FAST = "fast"  # an unshaped veth


def parse_rate(text: str | float | None) -> float | None:
    """``"100mbit"`` -> 1e8 (bits per second); tc's units, k/m/g = powers of 1000.

    ``None`` or ``"fast"``: no shaping (returns None).
    """
    if text is None or (isinstance(text, str) and text.strip().lower() == FAST):
        return None
    if isinstance(text, (int, float)):
        return float(text)
    match = _RATE_RE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"invalid rate {text!r}: expected e.g. 100mbit, 1gbit, 500kbit")
    unit = match.group(2).lower() if match.group(2) else None
    return float(match.group(1)) * _RATE_UNITS[unit]


def parse_latency(text: str | float) -> float:
    """``"1ms"`` -> 0.001 (seconds); a bare number is milliseconds, ``0`` means none."""
    if isinstance(text, (int, float)):
        return float(text)
    match = _TIME_RE.match(text)
    if not match:
        raise ValueError(f"invalid latency {text!r}: expected e.g. 1ms, 500us, 0")
    unit = match.group(2).lower() if match.group(2) else None
    return float(match.group(1)) * _TIME_UNITS[unit]


def rate_label(bits_per_s: float | None) -> str:
    """1e8 -> ``"100mbit"`` (for file names); None (unshaped) -> ``"fast"``."""
    if bits_per_s is None:
        return FAST
    for unit, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= factor and (bits_per_s / factor).is_integer():
            return f"{int(bits_per_s / factor)}{unit}"
    return f"{bits_per_s:g}bit"
