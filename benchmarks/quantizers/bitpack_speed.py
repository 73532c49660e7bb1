"""Pack + unpack time of gradsift.compressors.bitpack beside the two packers it replaced.

Usage (repository root): flock /tmp/gradsift-cpu.lock python benchmarks/quantizers/bitpack_speed.py
Writes results/quantizers/bitpack_speed.json. The packers, each loaded from git where it is not
the current one: ``expand`` (commit 720bd68, then src/gradsift/bitpack.py) expanded every code
into b uint8 bits; ``word`` (commit 3bf43bd) shifted groups of 8 codes into one int64 word and
cut it into b bytes; ``planes`` (the current module) ORs 8 contiguous uint8 planes of codes
into b byte planes, and hands one-bit codes to NumPy's packbits. Widths 2, 4 and 8 take the
same byte-aligned path in ``word`` and ``planes``. All are timed in interleaved rounds on the same codes; medians of 15 rounds.
"""

import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from gradsift import get_compressor
from gradsift.compressors import bitpack, quantization

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance stamp, results folder
import provenance
from paths import results_dir

#: The replaced packers: name -> (commit, path of the module then).
REPLACED = {
    "expand": ("720bd68", "src/gradsift/bitpack.py"),
    "word": ("3bf43bd", "src/gradsift/compressors/bitpack.py"),
}


def module_at(name: str, commit: str, path: str):
    """The module at ``path`` as of ``commit``, loaded under the name ``bitpack_<name>``."""
    source = subprocess.run(
        ["git", "show", f"{commit}:{path}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # the package's layout moved since: its errors and validation are in gradsift.core now
    for moved in ("errors", "validation"):
        source = source.replace(f"from gradsift.{moved} import", f"from gradsift.core.{moved} import")
    copy = Path(f"/tmp/gradsift_bitpack_{name}.py")
    copy.write_text(source)
    spec = importlib.util.spec_from_file_location(f"bitpack_{name}", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NUMELS = (235_000, 4_000_000)
WIDTHS = (1, 2, 3, 5, 8)
#: QSGD's codec is timed with these packers (its 5-bit codes take the path they differ on).
QSGD_PACKERS = ("word", "planes")


def round_trip_ms(module, codes, bits):
    started = time.perf_counter()
    module.unpack(module.pack(codes, bits), bits, codes.numel())
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    stamp = provenance.start()  # codes and QSGD's input are drawn unseeded: timings do not depend on them
    packers = {name: module_at(name, *where) for name, where in REPLACED.items()} | {"planes": bitpack}
    rows = []
    for numel in NUMELS:
        for bits in WIDTHS:
            codes = torch.randint(0, 2**bits, (numel,), dtype=torch.uint8)
            times: dict[str, list[float]] = {name: [] for name in packers}
            for _ in range(15):
                for name, module in packers.items():
                    times[name].append(round_trip_ms(module, codes, bits))
            rows.append(
                {"numel": numel, "bits": bits, **{f"{k}_ms": statistics.median(v) for k, v in times.items()}}
            )
            print(rows[-1], flush=True)
    qsgd = get_compressor("qsgd")
    codec: dict[str, dict[str, float]] = {}
    for numel in NUMELS:
        x = torch.randn(numel)
        times = {
            f"{name}_{part}": []
            for name in QSGD_PACKERS
            for part in ("compress_ms", "decompress_4_workers_ms")
        }
        for _ in range(15):
            for name in QSGD_PACKERS:  # QSGD's codec with each packer in turn
                quantization.pack, quantization.unpack = packers[name].pack, packers[name].unpack
                started = time.perf_counter()
                payload = qsgd.compress(x)
                times[f"{name}_compress_ms"].append((time.perf_counter() - started) * 1e3)
                started = time.perf_counter()
                qsgd.decompress([payload] * 4, x.numel())
                times[f"{name}_decompress_4_workers_ms"].append((time.perf_counter() - started) * 1e3)
        codec[str(numel)] = {k: statistics.median(v) for k, v in times.items()}
        print({"qsgd": numel, **codec[str(numel)]}, flush=True)
    quantization.pack, quantization.unpack = bitpack.pack, bitpack.unpack
    result = {
        "threads": 1,
        "round_trip": rows,
        "qsgd": codec,
        "provenance": stamp.finish(),
    }
    out = results_dir(__file__)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bitpack_speed.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
