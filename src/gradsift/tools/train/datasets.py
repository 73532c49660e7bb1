"""The data of each model: Fashion-MNIST for the image models, stdlib text for the LM.

Both kinds are indexed the same way (``split[indices] -> (inputs, targets)``), so the
training loop, the shards and the evaluation do not know which one they run on.
"""

from __future__ import annotations

from pathlib import Path

from gradsift.tools.train import text
from gradsift.tools.train.data import load_dataset, train_size
from gradsift.tools.train.models import DATA_OF_MODEL


def is_language_model(model: str) -> bool:
    """True when ``model`` trains on text (its metric is the validation loss)."""
    return DATA_OF_MODEL[model] == "python-stdlib"


def load_for_model(model: str, data_dir: str | Path | None, *, synthetic: bool, seed: int):
    """``(train, evaluation, source)`` for ``model``; ``source`` is a string for ``summary.json``."""
    if not is_language_model(model):
        return load_dataset(data_dir, synthetic=synthetic, seed=seed)
    if synthetic:
        return text.load_synthetic_text(seed)
    train, evaluation, corpus = text.load_text(data_dir)
    return train, evaluation, corpus.describe()


def examples_for_model(model: str, data_dir: str | Path | None = None, *, synthetic: bool = False) -> int:
    """Training examples (images, or text windows) of ``model``'s data: one epoch's worth."""
    if not is_language_model(model):
        return train_size(data_dir, synthetic=synthetic)
    return len(load_for_model(model, data_dir, synthetic=synthetic, seed=0)[0])
