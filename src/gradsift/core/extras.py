"""Optional dependencies, grouped into pip extras.

Each extra of ``pyproject.toml`` is one entry of :data:`EXTRAS`. Code that needs an
optional package imports it through :func:`require`, so a missing package fails with
:class:`~gradsift.core.errors.MissingExtraError` naming the command that fixes it
(``pip install 'gradsift[lightning]'``) instead of a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from gradsift.core.errors import InvalidOptionError, MissingExtraError

#: extra name -> what it enables (the pip extra installs the packages behind it).
EXTRAS: dict[str, str] = {
    "plot": "plots in `gradsift report` (matplotlib)",
    "tensorboard": "hook statistics in TensorBoard (tensorboard, for torch.utils.tensorboard)",
    "lightning": "the PyTorch Lightning callback (pytorch-lightning)",
    "accelerate": "Hugging Face Accelerate examples (accelerate)",
    "transformers": "the Hugging Face Trainer callback (transformers)",
    "docs": "building this documentation (mkdocs, mkdocs-material, mkdocstrings)",
}


def install_hint(extra: str) -> str:
    """The shell command that installs ``extra``, e.g. ``pip install 'gradsift[plot]'``."""
    if extra not in EXTRAS:
        raise InvalidOptionError(f"extra must be one of {', '.join(EXTRAS)}; got {extra!r}")
    return f"pip install 'gradsift[{extra}]'"


def require(module: str, extra: str, *, purpose: str | None = None) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming the pip extra to install.

    Args:
        module: dotted module name, e.g. ``"pytorch_lightning"``.
        extra: the gradsift extra that provides it (a key of :data:`EXTRAS`).
        purpose: what the caller wanted to do, for the message (default: the extra's description).
    """
    hint = install_hint(extra)
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingExtraError(
            f"{purpose or EXTRAS[extra]} needs the Python package {module!r}, which is not "
            f"importable ({error}); install it with: {hint}"
        ) from error
