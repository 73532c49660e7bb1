"""Which methods are timed side by side, in which groups, and their raw samples.

For every gradient size ``n`` and target density ``ratio``, one *group* of methods
is timed side by side on the same tensor ``x`` (:func:`measure_all`):

* ``floor``: ``torch.linalg.vector_norm(x, 1)`` -- one read pass over ``x``, the
  least any method that looks at every element can cost;
* ``topk``: ``torch.topk(x.abs(), k, sorted=False)`` -- what a sparsifier must beat;
* each compressor: the DDP hook's own calls (:class:`~.hook_encoder.HookEncoder`), not
  the public ``compress()``/``decompress()``.

Compressors without a ``ratio`` option (dense casts, quantizers) form one extra group
per size (``ratio=None``). ``threshold`` gets the oracle ``eta`` = the ``k``-th largest
``|x|``, so it selects about ``k``: its time is that of one comparison pass (its
capacity, adaptive as in the hook, has room for them from its second step on, so
after one warm-up call). The same ``x`` is compressed every time (no error feedback),
with the same ``key``. Each group is timed by the protocol of :mod:`~.timing`, per
phase (``compress``, ``decompress``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from gradsift.compressors import available_compressors, compressor_class, get_compressor
from gradsift.compressors.base import Compressor, target_count
from gradsift.core.errors import GradsiftError
from gradsift.core.payload import Payload
from gradsift.tools.benchmarking.config import DTYPES, CompressBenchConfig
from gradsift.tools.benchmarking.hook_encoder import HookEncoder
from gradsift.tools.benchmarking.synthetic import synthetic_gradient
from gradsift.tools.benchmarking.timing import rounds, synchronizer, timed_ms

#: Labels of the two reference measurements (parenthesised: never a registry name).
FLOOR, TOPK = "(floor)", "(torch.topk)"


def density_option(name: str) -> str | None:
    """The option that sets a compressor's density: ``"ratio"``, ``"threshold"`` or None."""
    return compressor_class(name).density_option


def benchmarkable(names: Sequence[str] | None, device: str) -> tuple[list[str], dict[str, str]]:
    """Split ``names`` (default: the registry) into those that compress a flat tensor and the rest.

    A compressor is skipped, with the reason, when its module does not import, when
    it needs the model's parameters (``needs_parameters``), or when a probe step of the
    hook's encode (:class:`~.hook_encoder.HookEncoder`) of a small tensor raises a gradsift
    error (e.g. PowerSGD, which runs its own collectives).
    """
    usable, skipped = [], {}
    for name in available_compressors() if names is None else names:
        try:
            cls = compressor_class(name)
        except ImportError as error:
            skipped[name] = f"not importable: {error}"
            continue
        if cls.needs_parameters:
            skipped[name] = "needs the model's parameters (needs_parameters); measured in training runs"
            continue
        option = density_option(name)
        try:
            probe = HookEncoder(get_compressor(name, **({} if option is None else {option: 0.5})))
            probe.encode(torch.randn(64, device=device))
            probe.close()
        except GradsiftError as error:
            skipped[name] = str(error)
            continue
        usable.append(name)
    return usable, skipped


@dataclass
class _Method:
    """One timed method of a group: ``run()`` returns a payload (or a tensor for baselines);
    ``close()`` runs untimed after each call (a compressor's step close)."""

    label: str
    run: Callable[[], Any]
    decompress: Callable[[Any], torch.Tensor] | None = None
    options: dict[str, Any] | None = None  # a compressor's options; None for the baselines
    close: Callable[[], None] = lambda: None


def _group_methods(x: torch.Tensor, ratio: float | None, names: Sequence[str]) -> list[_Method]:
    """The floor, (for a ratio) bare top-k, and a fresh instance of each compressor."""
    numel = x.numel()
    out = torch.empty_like(x)  # the bucket's result the hook decodes into, one for the group
    methods = [_Method(FLOOR, lambda: torch.linalg.vector_norm(x, 1))]
    if ratio is not None:
        k = target_count(numel, ratio)
        methods.append(_Method(TOPK, lambda: torch.topk(x.abs(), k, sorted=False)))
        oracle_eta = float(torch.topk(x.abs(), k, sorted=False).values.min())
    for name in names:
        option = density_option(name)
        if (option is None) != (ratio is None):
            continue
        options = {} if option is None else {option: oracle_eta if option == "threshold" else ratio}
        methods.append(_compressor_method(name, get_compressor(name, **options), x, out))
    return methods


def _compressor_method(name: str, compressor: Compressor, x: torch.Tensor, out: torch.Tensor) -> _Method:
    """The hook's encode of ``x`` and decode of its payload into ``out``, as a timed method."""
    encoder = HookEncoder(compressor)

    def run() -> Payload:
        return encoder.encode(x)

    def decompress(payload: Payload) -> torch.Tensor:
        compressor.decompress_into([payload], out)
        return out

    return _Method(name, run, decompress, compressor.options(), encoder.close)


def _measure_group(
    methods: Sequence[_Method], config: CompressBenchConfig, progress: tqdm
) -> dict[str, dict[str, list]]:
    """Warm up each method, then time ``repeats`` interleaved rounds; raw samples per label."""
    sync = synchronizer(config.device)
    samples: dict[str, dict[str, list]] = {
        m.label: {"compress": [], "decompress": [], "count": [], "nbytes": []} for m in methods
    }
    for method in methods:
        for _ in range(config.warmup):
            out = method.run()
            if method.decompress is not None:
                method.decompress(out)
            method.close()
            progress.update(1)
    for method in rounds(methods, config.repeats):
        out, ms = timed_ms(method.run, sync)
        record = samples[method.label]
        record["compress"].append(ms)
        if method.decompress is not None:
            record["decompress"].append(timed_ms(functools.partial(method.decompress, out), sync)[1])
            record["count"].append(out.count)  # entries in use (a host read, untimed)
            record["nbytes"].append(out.nbytes)  # on the wire: padding to capacity included
        method.close()
        del out
        progress.update(1)
    return samples


def _ratios(config: CompressBenchConfig, names: Sequence[str]) -> list[float | None]:
    """The ratios timed per size: each configured ratio if any compressor takes one, then None for the rest."""
    ratio_less = any(density_option(name) is None for name in names)
    with_ratio = any(density_option(name) is not None for name in names)
    return [*(config.ratios if with_ratio else []), *([None] if ratio_less else [])]


def measure_all(
    config: CompressBenchConfig, names: Sequence[str], *, progress: bool = False, barrier: Any = None
) -> list[dict[str, Any]]:
    """Raw samples of every (size, ratio) group, in order: ``[{numel, ratio, element_size, options, samples}]``.

    ``barrier`` (contended mode) is waited on before each group, so that concurrent
    processes time the same group at the same time.
    """
    ratios = _ratios(config, names)
    per_group = {ratio: 1 + (ratio is not None) + sum((density_option(n) is None) == (ratio is None) for n in names)
                 for ratio in ratios}  # fmt: skip
    total = sum(per_group.values()) * len(config.sizes) * (config.warmup + config.repeats)
    previous_threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    groups = []
    try:
        with tqdm(total=total, desc="bench compress", unit="call", disable=not progress) as bar:
            for numel in config.sizes:
                x = synthetic_gradient(numel, config.seed, config.device, DTYPES[config.dtype])
                for ratio in ratios:
                    bar.set_postfix(numel=numel, ratio=ratio)
                    methods = _group_methods(x, ratio, names)
                    if barrier is not None:
                        barrier.wait()
                    groups.append({
                        "numel": numel, "ratio": ratio, "element_size": x.element_size(),
                        "options": {m.label: m.options for m in methods if m.options is not None},
                        "samples": _measure_group(methods, config, bar),
                    })  # fmt: skip
                del x
    finally:
        torch.set_num_threads(previous_threads)
    return groups
