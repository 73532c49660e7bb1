"""Estimation quality and distribution fits on saved gradients (``gradsift analyze``).

*Estimation quality* of a threshold sparsifier is ``achieved count / target count``
per call, ``target = max(1, floor(n * ratio))`` (SIDCo paper, Sec. 5). A compressor is
called repeatedly -- on the same tensor, or on a sequence of gradients, optionally
closing the error-feedback loop -- so that online adaptation shows in the series;
the series is summarised by its median and 10th/90th percentiles.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradsift.compressors.base import Compressor, target_count
from gradsift.compressors.registry import compressor_class, get_compressor
from gradsift.compressors.stats import goodness_of_fit, subsample
from gradsift.core.errors import InvalidOptionError, InvalidTensorError
from gradsift.core.finite import nonfinite
from gradsift.core.plain import read_plain
from gradsift.hook.feedback import ErrorFeedback

#: Compressors `gradsift analyze` runs by default: SIDCo and the threshold baselines.
DEFAULT_COMPRESSORS = ("sidco-exp", "sidco-gpareto", "sidco-gamma", "topk", "dgc", "redsync", "gaussiank")
MAGNITUDE_FAMILIES = ("exponential", "gpareto", "gamma")


def load_gradients(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a torch file holding a tensor or a dict ``name -> tensor``, safely.

    :func:`gradsift.core.plain.read_plain` (``torch.load(..., weights_only=True)``) only
    rebuilds tensors and plain containers; a file whose pickle would run code or build other
    objects is refused with :class:`~gradsift.core.errors.UntrustedDataError`. A bare tensor is
    returned as ``{"tensor": t}``. Every entry must be a floating-point tensor with elements,
    all finite (a fit and a threshold have nothing to say otherwise): the first that is not is
    refused by name.
    """
    path = Path(path)
    if not path.is_file():
        raise InvalidOptionError(f"FILE {str(path)!r} does not exist or is not a file")
    loaded = read_plain(path, f"FILE {str(path)!r}")
    tensors = {"tensor": loaded} if isinstance(loaded, torch.Tensor) else loaded
    if not isinstance(tensors, dict) or not tensors:
        raise InvalidOptionError(f"FILE {str(path)!r} must hold a tensor or a non-empty dict name -> tensor")
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            got = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
            raise InvalidTensorError(f"FILE entry {name!r} must be a floating-point tensor, got {got}")
        if value.numel() == 0:
            raise InvalidTensorError(f"FILE entry {name!r} has no elements")
        if bool(nonfinite(value)):
            raise InvalidTensorError(f"FILE entry {name!r} holds NaN or Inf: analyze a finite gradient")
    return {str(name): value for name, value in tensors.items()}


def usable_compressors(names: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """(names to run, default names skipped because their module does not import yet).

    Explicitly requested names must exist (an unknown or broken one raises); only
    the defaults are skipped when their implementation is missing.
    """
    if names:
        for name in names:
            compressor_class(name)
        return list(names), []
    usable, skipped = [], []
    for name in DEFAULT_COMPRESSORS:
        try:
            compressor_class(name)
        except ImportError:
            skipped.append(name)
        else:
            usable.append(name)
    return usable, skipped


def percentile_summary(values: Sequence[float]) -> dict[str, float]:
    """Median and 10th/90th percentiles (linear interpolation) of a series."""
    if not values:
        return {"median": math.nan, "p10": math.nan, "p90": math.nan}
    p10, median, p90 = np.percentile(np.asarray(values, dtype=np.float64), [10, 50, 90])
    return {"median": float(median), "p10": float(p10), "p90": float(p90)}


def estimation_series(
    compressor: Compressor,
    gradients: Iterable[torch.Tensor],
    *,
    key: Hashable = 0,
    feedback: ErrorFeedback | None = None,
) -> dict[str, Any]:
    """Compress each gradient in turn; per call: achieved/target and milliseconds.

    With ``feedback`` the loop is closed as in training: the compressor sees
    ``g + residual`` and the residual keeps what it did not send, so threshold
    estimators face their own gradient build-up.
    """
    ratios, times_ms, counts = [], [], []
    target = 0
    for gradient in gradients:
        tensor = feedback.compensate(key, gradient) if feedback is not None else gradient
        start = time.perf_counter()
        payload = compressor.compress(tensor, key=key)
        times_ms.append(1e3 * (time.perf_counter() - start))
        if feedback is not None:
            feedback.update(key, tensor, payload, compressor)
        target = target_count(payload.numel, 1.0 if compressor.ratio is None else compressor.ratio)
        counts.append(payload.count)
        ratios.append(payload.count / target if target else math.nan)
    return {
        "target": target,
        "achieved": counts,
        "ratio_series": ratios,
        "quality": percentile_summary(ratios),
        "time_ms": percentile_summary(times_ms)["median"],
    }


def analyze_tensor(
    name: str, tensor: torch.Tensor, compressors: Sequence[str], ratios: Sequence[float], calls: int
) -> dict[str, Any]:
    """Fits + KS distances of ``tensor`` and each compressor's estimation quality at each ratio."""
    flat = tensor.detach().reshape(-1)
    estimation = []
    for compressor_name in compressors:
        for ratio in ratios:
            compressor = get_compressor(compressor_name, ratio=ratio)
            series = estimation_series(compressor, [flat] * calls)
            estimation.append({"compressor": compressor_name, "ratio": ratio, **series})
    return {
        "name": name,
        "numel": flat.numel(),
        "dtype": str(flat.dtype),
        "fits": goodness_of_fit(flat),
        "estimation": estimation,
    }


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """A readable text report: per tensor the fits, then one row per compressor x ratio."""
    lines = []
    for result in results:
        fits = result["fits"]
        lines.append(
            f"== {result['name']}  numel={result['numel']}  dtype={result['dtype']}  zeros={fits['zero_fraction']:.1%}"
        )
        for family in (*MAGNITUDE_FAMILIES, "normal"):
            params = ", ".join(f"{k}={v:.4g}" for k, v in fits[family]["params"].items())
            lines.append(f"   fit {family:<12} KS={fits[family]['ks']:.4f}  {params}")
        rows = [("compressor", "ratio", "target", "achieved", "median", "p10", "p90", "ms")]
        for row in result["estimation"]:
            q = row["quality"]
            rows.append(
                (row["compressor"], f"{row['ratio']:g}", str(row["target"]), str(row["achieved"][-1]),
                 f"{q['median']:.3f}", f"{q['p10']:.3f}", f"{q['p90']:.3f}", f"{row['time_ms']:.2f}")
            )  # fmt: skip
        widths = [max(len(cells[i]) for cells in rows) for i in range(len(rows[0]))]
        for cells in rows:  # the name left-aligned, the numbers right-aligned, two spaces apart
            numbers = "  ".join(cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
            lines.append(f"   {cells[0].ljust(widths[0])}  {numbers}")
    return "\n".join(lines)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise InvalidOptionError("--plot needs matplotlib: pip install gradsift[plot]") from error
    return plt


def plot_fits(
    result: dict[str, Any], tensor: torch.Tensor, directory: str | Path, *, points: int = 20_000
) -> list[Path]:
    """Write ``<name>-hist.png`` (magnitude histogram + fitted densities, log axes) and ``<name>-qq.png``.

    The Q-Q plot puts the sorted non-zero magnitudes of a fixed-seed subsample against
    each family's quantiles at plotting positions ``(i - 0.5)/n``; a good fit lies on
    the diagonal.
    """
    from gradsift.compressors.stats import ExponentialFit, GammaFit, GeneralizedParetoFit, MagnitudeFit

    plt = _pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    magnitudes = subsample(tensor, 200_000).double().abs()
    nonzero = magnitudes[magnitudes > 0].numpy()
    fits = result["fits"]
    families: dict[str, MagnitudeFit] = {
        "exponential": ExponentialFit(**fits["exponential"]["params"]),
        "gpareto": GeneralizedParetoFit(**fits["gpareto"]["params"]),
        "gamma": GammaFit(**fits["gamma"]["params"]),
    }
    if nonzero.size < 2:
        return []
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in result["name"])
    written = [directory / f"{stem}-hist.png", directory / f"{stem}-qq.png"]
    fig, ax = plt.subplots(figsize=(6, 4))
    bins = np.geomspace(nonzero.min(), nonzero.max(), 80)
    ax.hist(nonzero, bins=bins, density=True, alpha=0.4, label="|g| (non-zero)")
    grid = np.geomspace(bins[0], bins[-1], 400)
    for family, fit in families.items():
        ax.plot(grid, fit.distribution().pdf(grid), label=f"{family} (KS {fits[family]['ks']:.3f})")
    ax.set(xscale="log", yscale="log", xlabel="|g|", ylabel="density", title=result["name"])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(written[0], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 5))
    sample = np.sort(subsample(torch.from_numpy(nonzero), points).numpy())
    positions = (np.arange(1, sample.size + 1) - 0.5) / sample.size
    for family, fit in families.items():
        ax.plot(fit.distribution().ppf(positions), sample, ".", markersize=2, label=family)
    ax.plot([sample[0], sample[-1]], [sample[0], sample[-1]], "k--", linewidth=1)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="fitted quantile",
        ylabel="sample quantile",
        title=f"{result['name']} Q-Q",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(written[1], dpi=100)
    plt.close(fig)
    return written
