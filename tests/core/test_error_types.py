"""Every error gradsift raises on purpose is a :class:`gradsift.core.errors.GradsiftError`.

Two checks against the source itself, not a list kept by hand: every exception class
defined anywhere in the package derives from ``GradsiftError``, and every ``raise
Name(...)`` in ``src/gradsift`` constructs one of those classes -- built-in exception types
only where :data:`INTERNAL` names the site and says why it is not a user's error.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
from pathlib import Path

import gradsift
from gradsift.core.errors import GradsiftError, MissingExtraError

SOURCE = Path(gradsift.__file__).resolve().parent

#: ``(file relative to src/gradsift, exception)``: raises of built-in types that report a bug
#: in gradsift, not a user's mistake (nothing a caller could fix, or catch on purpose).
INTERNAL = {
    ("core/readout.py", "RuntimeError"),  # a readout slot read before the step's one host read: a code bug
    ("hook/ledger.py", "RuntimeError"),  # a step opened before the last one settled: a code bug
    ("__init__.py", "AttributeError"),  # the module __getattr__ protocol (PEP 562) for unknown names
    ("tools/train/launcher.py", "SystemExit"),  # the launcher's exit status on a signal, not an error
}


def gradsift_modules() -> list[object]:
    """Every importable module of the package (those needing an absent extra are skipped)."""
    modules = []
    for info in pkgutil.walk_packages(gradsift.__path__, prefix="gradsift."):
        if info.name.endswith("__main__"):  # importing it runs the command line
            continue
        try:
            modules.append(importlib.import_module(info.name))
        except (MissingExtraError, ImportError):
            continue
    return modules


def test_every_exception_class_of_the_package_derives_from_gradsift_error() -> None:
    classes = {
        cls
        for module in gradsift_modules()
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__.startswith("gradsift")
    }
    assert len(classes) >= 10  # errors.py's and the trainer's
    assert [c.__qualname__ for c in classes if not issubclass(c, GradsiftError)] == []


def raised_names(path: Path) -> list[tuple[str, int]]:
    """``(name, line)`` of every ``raise Name(...)`` / ``raise module.Name(...)`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            func = node.exc.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else None
            )
            if name is not None:
                found.append((name, node.lineno))
    return found


def test_every_raise_in_the_source_constructs_a_gradsift_error() -> None:
    builtin_errors = {
        n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
    }
    offenders, seen = [], 0
    for path in sorted(SOURCE.rglob("*.py")):
        relative = str(path.relative_to(SOURCE))
        for name, line in raised_names(path):
            seen += 1
            if name in builtin_errors and (relative, name) not in INTERNAL:
                offenders.append(f"{relative}:{line} raises {name}")
    assert seen > 100  # the walk reads the package's raises
    assert offenders == []


def test_the_source_check_catches_a_builtin_raise(tmp_path: Path) -> None:
    """Positive control: a file raising ValueError is found, one raising a GradsiftError is not."""
    (tmp_path / "bad.py").write_text("def f():\n    raise ValueError('x')\n")
    (tmp_path / "good.py").write_text("def f():\n    raise InvalidOptionError('x')\n")
    assert raised_names(tmp_path / "bad.py") == [("ValueError", 2)]
    assert raised_names(tmp_path / "good.py") == [("InvalidOptionError", 2)]
