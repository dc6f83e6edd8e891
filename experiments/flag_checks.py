"""Parse-time checks of experiment flags: a bad value stops a script before any work or write.

absl runs registered validators when it parses the command line, before `main`. These helpers
register one for a flag already defined, with a message that names the flag, the bad value and
what was expected:

    _GAMMAS = flags.DEFINE_list("gammas", ["1", "2"], "Drafted tokens per cycle.")
    flag_checks.int_list(_GAMMAS, min_value=1)
    _DRAFTERS = flags.DEFINE_list("drafters", ["model", "ngram"], "Drafters.")
    flag_checks.choice_list(_DRAFTERS, ("model", "ngram"))

List flags stay lists of strings (the scripts convert them where they use them); the check only
guarantees that the conversion succeeds and the values are in range.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from absl import flags


def _fail(why: str):
    raise flags.ValidationError(why)  # absl prefixes it with "flag --NAME=VALUE: "


def _bounds_text(min_value, max_value, above) -> str:
    parts = []
    if above is not None:
        parts.append(f"> {above}")
    if min_value is not None:
        parts.append(f">= {min_value}")
    if max_value is not None:
        parts.append(f"<= {max_value}")
    return " and ".join(parts)


def _check_number(x, *, min_value=None, max_value=None, above=None, noun="a finite number"):
    if not math.isfinite(x) or (
        (min_value is not None and x < min_value)
        or (max_value is not None and x > max_value)
        or (above is not None and x <= above)
    ):
        bounds = _bounds_text(min_value, max_value, above)
        _fail(f"{x!r} is not {noun} {bounds}".rstrip())


def _number_list(kind, holder, *, min_value, max_value, above, length, allow_empty) -> None:
    noun = "an integer" if kind is int else "a finite number"

    def check(values):
        values = list(values or [])
        if not values and not allow_empty:
            _fail("expected at least one value")
        if length is not None and len(values) != length:
            _fail(f"expected exactly {length} values")
        for v in values:
            try:
                x = kind(v)
            except (TypeError, ValueError):
                _fail(f"{v!r} is not {noun}")
            bounds = dict(min_value=min_value, max_value=max_value, above=above)
            _check_number(x, noun=noun, **bounds)
        return True

    flags.register_validator(holder.name, check)


def int_list(
    holder: flags.FlagHolder,
    *,
    min_value: int | None = None,
    max_value: int | None = None,
    length: int | None = None,
    allow_empty: bool = False,
) -> None:
    """Every item of the list flag parses as an int within the bounds."""
    _number_list(
        int,
        holder,
        min_value=min_value,
        max_value=max_value,
        above=None,
        length=length,
        allow_empty=allow_empty,
    )


def float_list(
    holder: flags.FlagHolder,
    *,
    min_value: float | None = None,
    max_value: float | None = None,
    above: float | None = None,
    allow_empty: bool = False,
) -> None:
    """Every item of the list flag parses as a finite float within the bounds (`above`: >)."""
    _number_list(
        float,
        holder,
        min_value=min_value,
        max_value=max_value,
        above=above,
        length=None,
        allow_empty=allow_empty,
    )


def choice_list(holder: flags.FlagHolder, allowed: Iterable[str], *, allow_empty=False) -> None:
    """Every item of the list flag is one of `allowed` (named in the message), none twice."""
    allowed = tuple(allowed)

    def check(values):
        values = list(values or [])
        if not values and not allow_empty:
            _fail(f"expected at least one of {', '.join(allowed)}")
        for v in values:
            if v not in allowed:
                _fail(f"{v!r} is not one of {', '.join(allowed)}")
        if len(set(values)) != len(values):
            _fail("a value is repeated")
        return True

    flags.register_validator(holder.name, check)


def each(holder: flags.FlagHolder, parse: Callable[[str], object]) -> None:
    """Every item of the list flag is accepted by `parse`, whose ValueError is the message."""

    def check(values):
        for v in values or []:
            try:
                parse(v)
            except ValueError as e:
                _fail(f"{v!r}: {e}")
        return True

    flags.register_validator(holder.name, check)


def number(
    holder: flags.FlagHolder,
    *,
    min_value: float | None = None,
    max_value: float | None = None,
    above: float | None = None,
) -> None:
    """A float flag is finite and within the bounds (None, an unset optional flag, passes).

    absl's own `lower_bound` lets NaN through and has no exclusive bound.
    """

    def check(value):
        if value is not None:
            bounds = dict(min_value=min_value, max_value=max_value, above=above)
            _check_number(value, **bounds)
        return True

    flags.register_validator(holder.name, check)
