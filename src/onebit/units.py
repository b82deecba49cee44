"""Link rates and delays as people write them (``tc``'s notation): ``100mbit``, ``50us``.

Shared by the emulated cluster, the benchmarks' options and the cost model.
"""

from __future__ import annotations

import re

__all__ = ["parse_bandwidth", "parse_latency", "rate_option", "delay_option"]

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_RATE_RE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]?bit)")
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_TIME_RE = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s)")


def parse_bandwidth(bandwidth: str) -> float:
    """Return the rate in bits/s of a ``tc`` rate string such as ``'100mbit'`` or ``'1gbit'``.

    Units are decimal, as in ``tc``: ``kbit`` = 1e3, ``mbit`` = 1e6, ``gbit`` = 1e9 bits/s.
    """
    match = _RATE_RE.fullmatch(bandwidth.strip().lower()) if isinstance(bandwidth, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(
            f"bandwidth must be a positive rate such as '100mbit', '1gbit' or '10gbit' "
            f"(units: {', '.join(_RATE_UNITS)}), or None for unshaped links; got {bandwidth!r}"
        )
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def parse_latency(latency: str) -> float:
    """Return the delay in seconds of a string such as ``'100us'``, ``'0.1ms'`` or ``'1s'``."""
    match = _TIME_RE.fullmatch(latency.strip().lower()) if isinstance(latency, str) else None
    if match is None:
        raise ValueError(
            f"latency must be a delay such as '100us', '0.1ms' or '2ms' "
            f"(units: {', '.join(_TIME_UNITS)}), or None for no added delay; got {latency!r}"
        )
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


def rate_option(text: str) -> str | None:
    """An option's link rate such as ``1gbit``, checked; ``none`` (or ``unshaped``) for an
    unshaped link."""
    if text.lower() in ("none", "unshaped"):
        return None
    parse_bandwidth(text)
    return text


def delay_option(text: str) -> str | None:
    """An option's delay such as ``0.1ms``, checked; ``none`` for no added delay."""
    if text.lower() == "none":
        return None
    parse_latency(text)
    return text
