"""Every Python block of README.md and docs/ runs as written, or says why it does not.

Which blocks there are and what their markers mean: ``tests/support/doc_commands.py``. How
a block runs (2 gloo ranks, one launch per block) and the prelude that gives it the names
it takes from its context (``model``, ``grad``, ``ddp_model``, ...): ``tests/support/doc_python.py``.
A block that shows a file (docs/extending.md's examples) must equal it; the file runs in
tests/project/test_extending.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support import ROOT, doc_python
from support.distributed import run_workers
from support.doc_commands import PythonBlock, page_python_blocks, python_blocks
from support.doc_python import PRELUDE, free_names, initialises_group

BLOCKS = python_blocks()
RUNNABLE = [block for block in BLOCKS if not block.not_run and not block.shows]


# -- the rules (tests/support/doc_commands.py, tests/support/doc_python.py) -------------------
def test_python_blocks_follow_the_markers(tmp_path: Path) -> None:
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    (tmp_path / "examples").mkdir()
    page.write_text(
        "```python\na = 1\n```\n\n```bash\nls\n```\n<!-- continues -->\n```python\nb = a\n```\n\n"
        "<!-- not-run: needs a GPU -->\n```py\nc = 1\n```\n\n`examples/x.py`:\n\n```python\nd = 1\n```\n",
        encoding="utf-8",
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("support.doc_commands.ROOT", tmp_path)
        first, exempt, shown = page_python_blocks(page)
        page.write_text("<!-- not-run `x`: a prefix -->\n```python\nx = 1\n```\n", encoding="utf-8")
        with pytest.raises(ValueError, match="shell blocks"):
            page_python_blocks(page)
    assert first == PythonBlock("docs/page.md:1", ((2, "a = 1\n"), (10, "b = a\n")))
    assert first.code == "a = 1\nb = a\n" and first.page == "docs/page.md"
    assert exempt.not_run == "needs a GPU" and exempt.parts == ((15, "c = 1\n"),)
    assert shown.shows == "examples/x.py" and not shown.not_run


def test_free_names_are_read_before_they_are_bound() -> None:
    code = (
        "import gradsift\n"
        "model, optimizer = prepare(model, optimizer)\n"
        "state = gradsift.register_comm_hook(model)\n"
        "for inputs, labels in loader:\n"
        "    loss_fn(model(inputs), labels).backward()\n"
        "squares = [x * x for x in grad]\n"
        "def f(a):\n"
        "    return a + offset\n"
        "total += 1\n"
        "print(state, ...)\n"
    )
    assert free_names(code) == [
        "prepare",
        "model",
        "optimizer",
        "loader",
        "loss_fn",
        "grad",
        "offset",
        "total",
    ]


def test_a_block_that_starts_the_group_is_recognised() -> None:
    assert initialises_group('import torch.distributed as dist\ndist.init_process_group("gloo")\n')
    assert initialises_group("from torch.distributed import init_process_group\ninit_process_group()\n")
    assert not initialises_group("dist.barrier()\n")


def test_every_page_with_python_runs_some_and_every_exemption_says_why() -> None:
    pages = {block.page for block in RUNNABLE}
    assert {
        "README.md",
        "docs/quickstart.md",
        "docs/distributed.md",
        "docs/integrations.md",
        "docs/sidco.md",
    } <= pages
    assert len(RUNNABLE) >= 18, "a block went missing: every page's Python blocks are found"
    for block in BLOCKS:
        if block.not_run:  # a reason in words (the marker's regular expression accepts an empty one)
            assert len(block.not_run.split()) >= 2, f"{block.source}: not-run without a reason"


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.source for block in RUNNABLE])
def test_a_block_reads_only_what_the_prelude_offers(block: PythonBlock) -> None:
    unknown = [name for name in free_names(block.code) if name not in PRELUDE]
    assert not unknown, (
        f"{block.source} reads {unknown}: define them in the block, or offer them in the prelude"
    )


SHOWN = [block for block in BLOCKS if block.shows]


@pytest.mark.parametrize("block", SHOWN, ids=[block.source for block in SHOWN])
def test_a_block_that_shows_a_file_is_that_file(block: PythonBlock) -> None:
    assert block.code == (ROOT / block.shows).read_text(encoding="utf-8"), (
        f"{block.source} differs from {block.shows}"
    )


# -- every block runs -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("block", RUNNABLE, ids=[block.source for block in RUNNABLE])
def test_documented_python_runs(block: PythonBlock, tmp_path: Path) -> None:
    results = run_workers(
        doc_python.__file__,
        "run_block",
        doc_python.WORLD,
        timeout=doc_python.BLOCK_TIMEOUT_S,
        parts=list(block.parts),
        page=block.page,
        directory=str(tmp_path),
    )
    failures = [
        f"--- rank {rank} ---\n{result['error']}" for rank, result in enumerate(results) if result["error"]
    ]
    assert not failures, f"{block.source} fails as written:\n" + "\n".join(failures)
    if "gather_hook_states" in block.code:  # rank 0's one file holds every rank's hook state
        (saved,) = [torch.load(path, map_location="cpu") for path in tmp_path.glob("*.pt")]
        (hooks,) = [value for value in saved.values() if isinstance(value, dict) and "ranks" in value]
        assert hooks["world_size"] == doc_python.WORLD and len(hooks["ranks"]) == doc_python.WORLD
