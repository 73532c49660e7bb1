"""The README opens with the generated verdict table, and says little before it.

Issue 45: the verdict first (one row per setting), at most 15 figures above it, every other
figure in the pages it links to. The table's cells are claims (benchmarks/registry.py,
``VERDICT_TABLE``); tests/project/test_claims.py checks that the text is what they render.
"""

from __future__ import annotations

import re

import claims
import registry

from support import ROOT

VERDICT = "readme-verdict"
MOST_ABOVE = 15
#: A measured figure: a number with a unit of time, size or rate, a factor (5.8x, not "4 x 2")
#: or a percentage.
FIGURE = re.compile(
    r"(?<![\w.^])\d[\d,]*(?:\.\d+)?(?:[-–]\d[\d,]*(?:\.\d+)?)?"
    r"(?:x\b|\s?(?:%|(?:ms|us|µs|s|min|minutes?|hours?|[kMG]?B|bytes?|[kMG]bit/s)(?![\w/])))"
)


def above_the_verdict() -> str:
    """README.md before the verdict table, with the claim markers' comments taken out."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.sub(r"<!-- /?claim(?::[\w.@\-]+)? -->", "", text.split(f"<!-- claims-table:{VERDICT} -->")[0])


def test_the_readme_opens_with_the_verdict_table() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = next(claims.BLOCK.finditer(text))
    assert first["name"] == VERDICT and first["text"] == f"{claims.BLOCKS[VERDICT].render()}\n"
    assert re.findall(r"^## .+$", text[: first.start()], flags=re.MULTILINE) == ["## The verdict"]
    assert [row[0] for row in registry.VERDICT_TABLE.rows] == [  # issue 45's rows, and issue 42's one line
        "slow link + SGD",
        "slow link + AdamW",
        "fast link",
        "any link, unknown to you",
        "GPU",
    ]


def test_at_most_15_figures_above_the_verdict() -> None:
    figures = FIGURE.findall(above_the_verdict())
    assert len(figures) <= MOST_ABOVE, figures


def test_the_figure_pattern_finds_what_it_must() -> None:
    for text in (
        "5.8x",
        "518 s",
        "154 ms",
        "1 %",
        "7%",
        "37.8 MB",
        "100 Mbit/s",
        "2–5 minutes",
        "2,439 bytes",
    ):
        assert FIGURE.fullmatch(text), text
    for text in ("4 x 2", "ratio 0.01", "2^19", "1-bit Adam", "torch 2.11", "3,000 steps", "sidco-exp"):
        assert not FIGURE.search(text), text
