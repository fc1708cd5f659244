"""What an option accepts beyond its type: a rule declared beside the option in sections.py (`opt(..., rule=...)`).

A rule is the words a user reads, in `KEY must be RULE (got VALUE)` and beside the option in `--help`, together
with the test behind them, so the two cannot drift apart. Every int and float option has one (tests/test_config.py
walks the options to hold new ones to it): a number outside what the trainer can use is refused in one line by
`train.py --check`, not by a traceback from torch on every rank after the mesh and model are built. Float rules
refuse NaN and +-inf too: NaN fails every comparison, but inf passes `> 0`, and no infinite lr, epsilon, weight
decay or clipping norm is a setting a run can honour.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple


# The longest timeout: a peer silent for a week is hung whatever it runs, and far longer ones overflow the timedelta
# that torch.distributed takes (10**14 s raised OverflowError on every rank at start-up).
WEEK = 7 * 24 * 3600


class Rule(NamedTuple):
    text: str  # as the user reads it after "must be"
    ok: Callable[[Any], bool]


def at_least(low: int, note: str = "") -> Rule:
    """An integer >= low; `note` says what the lowest value means."""
    return Rule(f">= {low}" + (f" ({note})" if note else ""), lambda v: v >= low)


def or_auto(rule: Rule, meaning: str = "") -> Rule:
    """`rule`, or -1 for a value the trainer works out (`meaning`; left out, the help line says it)."""
    text = f"-1 ({meaning}) or {rule.text}" if meaning else f"{rule.text} or -1"
    return Rule(text, lambda v: v == -1 or rule.ok(v))


def finite_above(low: float) -> Rule:
    return Rule(f"> {low:g} and finite", lambda v: math.isfinite(v) and v > low)


def finite_at_least(low: float, note: str = "") -> Rule:
    return Rule(f">= {low:g} and finite" + (f" ({note})" if note else ""), lambda v: math.isfinite(v) and v >= low)


def within(low: float, high: float, high_open: bool = False) -> Rule:
    """A float in [low, high], or [low, high) with `high_open` (Adam's betas: 1 would never forget)."""
    return Rule(f"in [{low:g}, {high:g}{')' if high_open else ']'}",
                lambda v: low <= v < high if high_open else low <= v <= high)


def words_or_count(words: tuple[str, ...], text: str) -> Rule:
    """A string option that is one of `words` or a positive integer."""
    return Rule(text, lambda v: v in words or (v.isdecimal() and int(v) >= 1))
