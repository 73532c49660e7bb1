"""The known name closest to a misspelt one, for the messages that refuse it.

A name is suggested when :func:`difflib.get_close_matches` rates it at least :data:`CLOSE`
alike (``2 * matches / (len(a) + len(b))``): high enough that an unrelated name is not
offered (docs/decisions.md, "An unknown flag is named by its command, with the closest
option"). Imports nothing but the standard library: the command line reads it before torch.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

#: How alike a misspelt name and a known one must be to be suggested (difflib's ratio, 0-1).
CLOSE = 0.75
#: The same for a compressor's registry name: short names with a family suffix (``sidco`` for
#: ``sidco-exp`` is 10 / 14 alike), so difflib's own default.
NAME_CLOSE = 0.6


def closest(name: str, known: Iterable[str], cutoff: float = CLOSE) -> str | None:
    """The name of ``known`` most like ``name``, if at least ``cutoff`` alike; else None."""
    matches = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
    return matches[0] if matches else None


def did_you_mean(suggestions: Iterable[str]) -> str:
    """``" (did you mean a, b?)"`` for ``suggestions``, each once in its first place; ``""`` for none."""
    unique = list(dict.fromkeys(suggestions))
    return f" (did you mean {', '.join(unique)}?)" if unique else ""
