"""Hook statistics into TensorBoard (``torch.utils.tensorboard``; extra ``tensorboard``).

Usage, on rank 0 only (every rank holds its own statistics; one writer per run)::

    from gradsift.integrations.tensorboard import open_writer, write_stats

    state = gradsift.register_comm_hook(ddp_model, "sidco-exp", ratio=0.01)
    writer = open_writer("runs/sidco") if dist.get_rank() == 0 else None
    for step, batch in enumerate(loader):
        ...
        if writer is not None:
            write_stats(writer, state.stats(), step)
"""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from typing import Any

from gradsift.core.extras import require
from gradsift.core.validation import check_int
from gradsift.integrations.telemetry import scalar_metrics


def open_writer(log_dir: str | PathLike[str]) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter`` writing event files under ``log_dir``.

    Raises :class:`~gradsift.core.errors.MissingExtraError` naming ``gradsift[tensorboard]``
    when TensorBoard is not installed.
    """
    module = require("torch.utils.tensorboard", "tensorboard", purpose="TensorBoard telemetry")
    return module.SummaryWriter(log_dir=str(log_dir))


def write_stats(
    writer: Any, stats: Mapping[str, Any], step: int, prefix: str = "gradsift"
) -> dict[str, float]:
    """Write every numeric entry of ``stats`` as a scalar at global step ``step``.

    Returns the scalars written (``tag -> value``), see
    :func:`gradsift.integrations.telemetry.scalar_metrics` for the naming.
    """
    step = check_int(step, "step", low=0)
    metrics = scalar_metrics(stats, prefix)
    for tag, value in metrics.items():
        writer.add_scalar(tag, value, global_step=step)
    return metrics
