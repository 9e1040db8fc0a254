"""A string enum base: members are their values (``"running"``) in JSON, dict keys and f-strings."""
from __future__ import annotations

from enum import Enum

__all__ = ["TextEnum"]


class TextEnum(str, Enum):
    """An ``Enum`` whose members behave as their string values: equal to, hashed as, printed and
    shown as (``repr`` too: a status in a list reads ``'running'``).

    (Python 3.10 has no ``StrEnum``; ``Enum`` would hash members by name, so a dict keyed by the
    value would miss them.)"""

    def __repr__(self) -> str:
        # A method of its own rather than ``str.__repr__`` itself: Sphinx (9.0) cannot render a
        # default value whose ``__repr__`` is a C slot.
        return str.__repr__(self)

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]
    __hash__ = str.__hash__
