"""Docstrings in src/ (and ``#:`` comments, a constant's documentation) state rules, not
measurements: a time, a measured factor or a size in one goes stale unseen (no claim check
reads it); it belongs in docs/decisions.md."""

from __future__ import annotations

import ast
import re

from support import ROOT

#: A time (12 ms, 7 us), a decimal or ranged factor (1.9x, 10-30x, but not "4x GELU" or "2 x n"),
#: a factor compared (6x faster, 70x fewer), or a size (56 GB).
MEASUREMENT = re.compile(
    r"\b\d+(?:\.\d+)?\s?(?:ms|us|µs)\b"
    r"|\b\d+(?:\.\d+)?-\d+(?:\.\d+)?x\b|\b\d+\.\d+x\b"
    r"|\b\d+x (?:faster|slower|fewer|more|less|smaller|larger|above|below)\b"
    r"|\b\d+(?:\.\d+)?\s?(?:MB|GB|kB)\b"
)
#: An attribute's documentation comment (``#:``, what Sphinx shows beside a constant).
ATTRIBUTE_DOC = re.compile(r"^\s*#:(?P<doc>.*)$", re.M)
#: (module, object): docstrings whose numbers are syntax, a rule's constant or arithmetic.
ALLOWED = {
    ("gradsift/tools/train/netem.py", "parse_delay"),  # the accepted spellings, "1ms", "500us"
    ("gradsift/tools/train/netem.py", "tbf_burst_bytes"),  # the rule: 2 ms of traffic
    ("gradsift/integrations/checkpoint.py", "parameter_digest"),  # 7e9 x 8 bytes = 56 GB
}


def measurements() -> list[str]:
    found = []
    for path in sorted((ROOT / "src" / "gradsift").rglob("*.py")):
        module = str(path.relative_to(ROOT / "src"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            name = getattr(node, "name", "<module>")
            doc = ast.get_docstring(node) or ""
            if (module, name) not in ALLOWED:
                found += [f"{module} {name}: {match.group(0)!r}" for match in MEASUREMENT.finditer(doc)]
        for comment in ATTRIBUTE_DOC.finditer(path.read_text(encoding="utf-8")):
            found += [f"{module} #: {match.group(0)!r}" for match in MEASUREMENT.finditer(comment["doc"])]
    return found


def test_no_measurement_in_a_docstring():
    assert measurements() == []


def test_the_pattern_finds_what_it_must():
    for text in (
        "took 16 ms",
        "7 us",
        "sent 1.9x the bytes",
        "moves it 10-30x",
        "56 GB",
        "6x faster",
        "70x fewer",
    ):
        assert MEASUREMENT.search(text), text
    for text in ("a 4x GELU MLP", "2 x demand", "ratio 0.01", "2^19 elements", "(1 - beta1)"):
        assert not MEASUREMENT.search(text), text
