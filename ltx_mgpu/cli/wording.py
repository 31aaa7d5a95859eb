"""Words for the command line's output: counts with the right noun form."""

from __future__ import annotations

__all__ = ["plural"]


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``count`` with ``noun`` in the singular for exactly 1, else in the plural (``nouns``,
    default ``noun + "s"``): ``plural(1, "frame")`` is ``"1 frame"``, ``plural(25, "frame")``
    ``"25 frames"``."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"
