"""One implementation each of the non-finite check, the step's poisoning and the step's lifecycle (issue 45).

* The non-finite check by a sum: ``isfinite``, ``isnan`` or ``isinf`` of a sum (directly,
  or of a name the same function assigned a sum to) is :func:`gradsift.core.finite.nonfinite`
  and nowhere else. A check on a statistic a method computes anyway (a maximum, a mean) is
  not a copy of it.
* The poisoning of a dropped step's tensors -- ``masked_fill_`` on a flag -- is
  :func:`gradsift.core.finite.fill_where` and nowhere else (the ledger's close and FSDP's
  unit call it).
* The step's lifecycle -- the readout's host read (``.read()``), then commit (``.commit()``)
  or roll back -- is :meth:`gradsift.core.transaction.Transaction.settle`, and the hook's
  own settle (:mod:`gradsift.hook.ledger`, which applies its policies between the two);
  every other module ends its transaction with ``settle``.
* The check that a flag is a bool ("must be True or False") is
  :func:`gradsift.core.validation.check_bool`, and the suggestion of a known name for a
  misspelt one (``difflib``) is :mod:`gradsift.core.spelling`, each nowhere else.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support import ROOT

PACKAGE = ROOT / "src" / "gradsift"
CHECKS = {"isfinite", "isnan", "isinf"}
SUMS = {"sum", "nansum"}
#: (module, function) of the one sum-based non-finite check.
NONFINITE = {("gradsift/core/finite.py", "nonfinite")}
#: (module, function) of the one poisoning step.
POISONING = {("gradsift/core/finite.py", "fill_where")}
#: Modules that read a readout and commit: the shared lifecycle and the hook's step.
LIFECYCLE = {"gradsift/core/transaction.py", "gradsift/hook/ledger.py"}
#: The one bool check's message, and the one module that matches names.
BOOL_MESSAGE = "must be True or False"
BOOL_CHECK = {"gradsift/core/validation.py"}
MATCHER = {"gradsift/core/spelling.py"}


def _called(call: ast.Call) -> str | None:
    """The called function's or method's name (``torch.isfinite`` and ``x.isfinite()``: isfinite)."""
    function = call.func
    return function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)


def _calls(node: ast.AST) -> list[ast.Call]:
    return [child for child in ast.walk(node) if isinstance(child, ast.Call)]


def _sums(function: ast.AST) -> tuple[set[str], bool]:
    """Names ``function`` assigns a sum to, and whether it calls a sum at all."""
    names = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(_called(call) in SUMS for call in _calls(value)):
            names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names, any(_called(call) in SUMS for call in _calls(function))


def _checks_a_sum(call: ast.Call, summed: set[str]) -> bool:
    """``call`` is isfinite/isnan/isinf of an expression holding a sum or a name assigned one."""
    if _called(call) not in CHECKS:
        return False
    operands = [*call.args, *([call.func.value] if isinstance(call.func, ast.Attribute) else [])]
    for operand in operands:
        for node in ast.walk(operand):
            if isinstance(node, ast.Call) and _called(node) in SUMS:
                return True
            if isinstance(node, ast.Name) and node.id in summed:
                return True
    return False


def nonfinite_checks(package: Path = PACKAGE) -> set[tuple[str, str]]:
    """(module, function) of every sum-based non-finite check under ``package``."""
    found = set()
    for path in sorted(package.rglob("*.py")):
        module = str(path.relative_to(package.parent))
        for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            summed, sums = _sums(function)
            if sums and any(_checks_a_sum(call, summed) for call in _calls(function)):
                found.add((module, function.name))
    return found


def poisonings(package: Path = PACKAGE) -> set[tuple[str, str]]:
    """(module, function) of every ``masked_fill_`` / ``masked_fill`` call under ``package``."""
    found = set()
    for path in sorted(package.rglob("*.py")):
        module = str(path.relative_to(package.parent))
        for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                _called(call) in {"masked_fill_", "masked_fill"} for call in _calls(function)
            ):
                found.add((module, function.name))
    return found


def lifecycles(package: Path = PACKAGE) -> set[str]:
    """Modules under ``package`` that call both ``.read()`` and ``.commit()`` without arguments."""
    found = set()
    for path in sorted(package.rglob("*.py")):
        bare = {
            _called(call)
            for call in _calls(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(call.func, ast.Attribute) and not call.args and not call.keywords
        }
        if {"read", "commit"} <= bare:
            found.add(str(path.relative_to(package.parent)))
    return found


def modules_saying(text: str, package: Path = PACKAGE) -> set[str]:
    """Modules whose source holds ``text`` (a message written by hand)."""
    return {
        str(path.relative_to(package.parent))
        for path in package.rglob("*.py")
        if text in path.read_text(encoding="utf-8")
    }


def difflib_importers(package: Path = PACKAGE) -> set[str]:
    """Modules that import :mod:`difflib`."""
    found = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if "difflib" in names:
                found.add(str(path.relative_to(package.parent)))
    return found


def test_one_bool_check_and_one_name_matcher():
    assert modules_saying(BOOL_MESSAGE) == BOOL_CHECK
    assert difflib_importers() == MATCHER


def test_one_sum_based_nonfinite_check():
    assert nonfinite_checks() == NONFINITE


def test_one_poisoning_step():
    assert poisonings() == POISONING


def test_one_step_lifecycle_outside_the_hook():
    assert lifecycles() == LIFECYCLE


def test_the_counts_find_a_copy(tmp_path):
    package = tmp_path / "gradsift"
    package.mkdir()
    (package / "copy.py").write_text(
        "import torch\n"
        "def direct(x):\n    return ~torch.isfinite(x.float().sum())\n"
        "def through_a_name(x):\n    total = x.sum(dtype=torch.float32)\n    return total.isnan()\n"
        "def a_maximum(x):\n    n = x.sum()\n    return ~torch.isfinite(x.amax())\n"
        "def step(transaction):\n    transaction.readout.read()\n    transaction.commit()\n"
        "def poison(result, flag):\n    result.masked_fill_(flag, float('nan'))\n"
        "def flag(x):\n    if not isinstance(x, bool):\n        raise ValueError(f'x must be True or False, got {x!r}')\n"
        "from difflib import get_close_matches\n"
    )
    assert nonfinite_checks(package) == {
        ("gradsift/copy.py", "direct"),
        ("gradsift/copy.py", "through_a_name"),
    }
    assert lifecycles(package) == {"gradsift/copy.py"}
    assert poisonings(package) == {("gradsift/copy.py", "poison")}
    assert modules_saying(BOOL_MESSAGE, package) == {"gradsift/copy.py"}
    assert difflib_importers(package) == {"gradsift/copy.py"}
