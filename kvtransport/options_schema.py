"""Backend options declared, not hand-checked: one schema per backend, one checker for all.

A backend lists its options as :class:`Option` rows (name, default, check) in an
:class:`OptionsSchema`; :meth:`OptionsSchema.parse` refuses unknown names (naming the known
ones) and checks every value, so every backend refuses a bad option the same way: a
:class:`~kvtransport.errors.BackendOptionError` that names the backend, the option, what it
must be and what was given. What depends on several options at once (ucx's transport list
and error mode, mooncake's chunk size against its in-flight cap) stays in the backend, after
the schema has checked each value alone.

The checks are small functions from a value to the checked value, raising ``ValueError``
with what the value must be: :func:`integer`, :func:`number`, :func:`one_of`,
:func:`boolean`, :func:`text`, :func:`mapping`, :func:`anything`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtransport.errors import BackendOptionError

__all__ = ["Option", "OptionsSchema", "anything", "boolean", "integer", "mapping", "number", "one_of", "text"]

Check = Callable[[Any], Any]
_UNSET = object()


@dataclass(frozen=True)
class Option:
    """One backend option: its name, its default (``default_factory`` when the default is
    computed when the backend opens, e.g. from the CPUs it may use), and its check."""

    name: str
    default: Any = None
    check: Check | None = None
    default_factory: Callable[[], Any] | None = None
    #: Whether the default also goes through ``check`` (False for a ``None`` meaning "unset").
    check_default: bool = False

    def value(self, given: Mapping[str, Any], backend: str) -> Any:
        raw = given.get(self.name, _UNSET)
        if raw is _UNSET:
            raw = self.default_factory() if self.default_factory is not None else self.default
            if not self.check_default:
                return raw
        if self.check is None:
            return raw
        try:
            return self.check(raw)
        except (ValueError, TypeError) as why:
            raise BackendOptionError(f"{backend} backend: {self.name} must be {why}, got {raw!r}") from None


class OptionsSchema:
    """The options of one backend; :meth:`parse` checks a caller's mapping against them."""

    def __init__(self, backend: str, *options: Option) -> None:
        self.backend = backend
        self.options = {o.name: o for o in options}

    @property
    def known(self) -> tuple[str, ...]:
        return tuple(self.options)

    def error(self, msg: str) -> BackendOptionError:
        """A refusal that names this backend (for checks spanning several options)."""
        return BackendOptionError(f"{self.backend} backend: {msg}")

    def parse(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every declared option's checked value (defaults for those not given)."""
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            raise self.error(f"unknown option(s) {unknown}; known options are {list(self.options)}")
        return {name: o.value(given, self.backend) for name, o in self.options.items()}


def integer(lo: int | None = None, hi: int | None = None, optional: bool = False) -> Check:
    """An int (not a bool) in ``[lo, hi]``; None too when ``optional``."""
    span = (f" from {lo} to {hi}" if lo is not None and hi is not None else
            f" >= {lo}" if lo is not None else f" <= {hi}" if hi is not None else "")
    want = f"an integer{span}" + (" or None" if optional else "")

    def check(v: Any) -> int | None:
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ValueError(want)
        return v
    return check


def number(gt: float | None = None, ge: float | None = None, le: float | None = None,
           convert: bool = False) -> Check:
    """A number (not a bool) ``> gt`` / ``>= ge`` / ``<= le``, as a float; ``convert`` also
    takes what ``float()`` takes (a numeric string)."""
    want = "a number" + "".join(f" {op} {b}" for op, b in ((">", gt), (">=", ge), ("<=", le)) if b is not None)

    def check(v: Any) -> float:
        if convert and not isinstance(v, bool):
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise ValueError(want) from None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(want)
        f = float(v)
        if (gt is not None and not f > gt) or (ge is not None and not f >= ge) or (le is not None and not f <= le):
            raise ValueError(want)
        return f
    return check


def one_of(*choices: Any) -> Check:
    """One of ``choices``."""
    def check(v: Any) -> Any:
        if v not in choices:
            raise ValueError(f"one of {list(choices)}")
        return v
    return check


def boolean(v: Any) -> bool:
    """True or False (a bool)."""
    if not isinstance(v, bool):
        raise ValueError("True or False")
    return v


def text(pattern: str | None = None, what: str = "a non-empty string", empty: bool = False,
         optional: bool = False) -> Check:
    """A string (non-empty unless ``empty``) matching ``pattern`` when given; None too when
    ``optional``. ``what`` is how the refusal describes it."""
    rx = re.compile(pattern) if pattern else None

    def check(v: Any) -> str | None:
        if v is None and optional:
            return None
        if not isinstance(v, str) or (not v and not empty) or (v and rx is not None and not rx.match(v)):
            raise ValueError(what)
        return v
    return check


def mapping(what: str = "a mapping") -> Check:
    """A mapping (None and empty mean none), returned as a dict."""
    def check(v: Any) -> dict:
        if not v:
            return {}
        if not isinstance(v, Mapping):
            raise ValueError(what)
        return dict(v)
    return check


def anything(v: Any) -> Any:
    """Any value (checked where it is used)."""
    return v
