"""Checks of configuration fields (type, then range), shared by the runtime's configs.

Each returns None when the value is good, else one sentence that names the field, the value
and what to give instead; the config raises its own error type with it:

    problem = check_int("hosts", self.hosts, minimum=1)
    if problem:
        raise ResourceValueError(f"ResourceRequest.{problem}")

Ints are Python or NumPy integers, never bools; numbers are ints or floats, finite.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection


def check_int(name: str, value: object, minimum: int, optional: bool = False) -> str | None:
    """An int >= `minimum` (None too when `optional`)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return (f"{name}={value!r}: give an int >= {minimum}{' or None' if optional else ''}, "
                f"not a {type(value).__name__}")
    if value < minimum:
        return f"{name}={value}: must be at least {minimum}"
    return None


def check_number(name: str, value: object, above: float | None = None,
                 at_least: float | None = None, at_most: float | None = None,
                 below: float | None = None) -> str | None:
    """A finite int or float within the bounds given (`above` and `below` exclusive)."""
    bounds = " and ".join(f"{word} {bound:g}" for word, bound in (
        (">", above), (">=", at_least), ("<=", at_most), ("<", below)) if bound is not None)
    wanted = "a finite number" + (f" {bounds}" if bounds else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"{name}={value!r}: give {wanted}, not a {type(value).__name__}"
    if not math.isfinite(value):
        return f"{name}={value}: give {wanted}"
    if ((above is not None and not value > above) or (at_least is not None and value < at_least)
            or (at_most is not None and value > at_most) or (below is not None
                                                           and not value < below)):
        return f"{name}={value}: must be {bounds}"
    return None


def check_bool(name: str, value: object) -> str | None:
    """True or False (not merely truthy: "no" would count as True)."""
    if not isinstance(value, bool):
        return f"{name}={value!r}: give True or False, not a {type(value).__name__}"
    return None


def check_choice(name: str, value: object, choices: Collection[str]) -> str | None:
    """One of `choices` (strings)."""
    if not isinstance(value, str) or value not in choices:
        return f"{name}={value!r}: use one of {tuple(choices)}"
    return None


def check_name(name: str, value: object, optional: bool = False) -> str | None:
    """A non-empty string (None too when `optional`)."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        return (f"{name}={value!r}: give a non-empty string{' or None' if optional else ''}")
    return None
