"""What ``gradsift bench compress`` measures: sizes, ratios, compressors, rounds, device, dtype."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradsift.compressors import compressor_class
from gradsift.core.validation import check_choice, check_int, check_ratio

#: ``--dtype`` names -> gradient dtypes.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def float32_capacity(device: str) -> int:
    """How many float32 values ``device`` holds at most: the machine's physical memory for the
    CPU, the first GPU's for CUDA, over 4 bytes (the synthetic gradient is drawn in float32)."""
    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory // 4
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


@dataclass
class CompressBenchConfig:
    """What ``gradsift bench compress`` measures (the protocol: :mod:`gradsift.tools.benchmarking`).

    Attributes:
        sizes: gradient lengths ``n``, each within the device's memory as float32 values.
        ratios: target densities in (0, 1].
        compressors: registry names; ``None`` means every one that can compress a
            flat tensor on its own (the others are reported as skipped, with why).
        repeats: timed rounds per group (median reported), >= 1.
        warmup: untimed calls per method before timing, >= 0.
        threads: ``torch.set_num_threads`` for the run (``None``: leave as is).
        device: ``"cpu"`` or ``"cuda"`` (timings then synchronise the device).
        dtype: the gradient's dtype, a key of :data:`DTYPES` (``"fp32"``, ``"bf16"``, ``"fp16"``).
        seed: seed of the synthetic gradient.
        processes: concurrent processes running the same measurement (>= 1; see
            :mod:`gradsift.tools.benchmarking.contended`).
    """

    sizes: Sequence[int] = (250_000, 1_000_000)
    ratios: Sequence[float] = (0.1, 0.01, 0.001)
    compressors: Sequence[str] | None = None
    repeats: int = 5
    warmup: int = 3
    threads: int | None = None
    device: str = "cpu"
    dtype: str = "fp32"
    seed: int = 0
    processes: int = 1

    def __post_init__(self) -> None:
        self.ratios = [check_ratio(r, "ratios") for r in self.ratios]
        self.repeats = check_int(self.repeats, "repeats", low=1)
        self.warmup = check_int(self.warmup, "warmup", low=0)
        if self.threads is not None:
            self.threads = check_int(self.threads, "threads", low=1)
        self.device = check_choice(self.device, "device", ("cpu", "cuda"))
        capacity = float32_capacity(self.device)  # a larger gradient cannot even be drawn
        self.sizes = [check_int(n, "sizes", low=1, high=capacity) for n in self.sizes]
        self.dtype = check_choice(self.dtype, "dtype", tuple(DTYPES))
        self.seed = check_int(self.seed, "seed", low=0)
        self.processes = check_int(self.processes, "processes", low=1)
        if self.compressors is not None:
            for name in self.compressors:
                compressor_class(name)  # unknown names fail here, before any timing
