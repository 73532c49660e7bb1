"""Write the index of docs/decisions.md: one line per decision, in the file's order, marked
where a later decision supersedes it (an entry whose first line starts ``*Superseded``
or ``*Its ... superseded``).

    python scripts/decisions_index.py           # rewrite the index between its markers
    python scripts/decisions_index.py --check   # exit 1 when the index is not up to date

tests/project/test_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import re
import sys
import unicodedata
from pathlib import Path

DECISIONS = Path(__file__).resolve().parents[1] / "docs" / "decisions.md"
OPEN, CLOSE = "<!-- decisions-index -->", "<!-- /decisions-index -->"


def anchor(title: str) -> str:
    """The heading's anchor as MkDocs makes it (Python-Markdown's ``toc.slugify``): ASCII
    only, punctuation dropped, lower case, runs of spaces and dashes to one dash."""
    text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def index(text: str) -> str:
    """The index lines for the decisions in ``text``."""
    lines = []
    entries = re.findall(r"^## (.+)\n(.*)$", text, flags=re.MULTILINE)
    for title, first in entries:
        if title == "Index":
            continue
        superseded = first.startswith("*") and "uperseded" in first
        lines.append(f"- [{title}](#{anchor(title)}){' (superseded, see the entry)' if superseded else ''}")
    return "\n".join(lines)


def rewritten(text: str) -> str:
    body = index(text)
    if OPEN in text:
        start, end = text.index(OPEN), text.index(CLOSE) + len(CLOSE)
        return text[:start] + f"{OPEN}\n{body}\n{CLOSE}" + text[end:]
    head, rest = text.split("\n## ", 1)
    return f"{head.rstrip()}\n\n## Index\n{OPEN}\n{body}\n{CLOSE}\n\n## {rest}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that the index is up to date")
    args = parser.parse_args()
    text = DECISIONS.read_text(encoding="utf-8")
    new = rewritten(text)
    if args.check:
        if new != text:
            print("docs/decisions.md: the index is out of date; run python scripts/decisions_index.py")
            return 1
        return 0
    DECISIONS.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
