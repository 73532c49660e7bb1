"""Pack + unpack time of gradsift.compressors.bitpack beside the bit-expansion packer it replaced.

Usage (repository root): flock /tmp/gradsift-cpu.lock python benchmarks/quantizers/bitpack_speed.py
Writes results/quantizers/bitpack_speed.json. The old packer (commit 720bd68, then src/gradsift/bitpack.py)
expanded every code into b uint8 bits; the current one packs groups of 8 codes into
one int64 word and cuts it into b bytes. Both are timed in interleaved rounds on the same codes; medians of 15 rounds.
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
from gradsift.compressors import bitpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance stamp, results folder
import provenance
from paths import results_dir


def old_module():
    source = subprocess.run(
        ["git", "show", "720bd68:src/gradsift/bitpack.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # the package's layout moved since: its errors and validation are in gradsift.core now
    for moved in ("errors", "validation"):
        source = source.replace(f"from gradsift.{moved} import", f"from gradsift.core.{moved} import")
    path = Path("/tmp/gradsift_bitpack_expand.py")
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("bitpack_expand", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def round_trip_ms(module, codes, bits):
    started = time.perf_counter()
    module.unpack(module.pack(codes, bits), bits, codes.numel())
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    stamp = provenance.start()  # codes and QSGD's input are drawn unseeded: timings do not depend on them
    old = old_module()
    rows = []
    for numel in (235_000, 4_000_000):
        for bits in (2, 5, 8):
            codes = torch.randint(0, 2**bits, (numel,))
            times = {"expand": [], "group": []}
            for _ in range(15):
                times["expand"].append(round_trip_ms(old, codes, bits))
                times["group"].append(round_trip_ms(bitpack, codes, bits))
            medians = {k: statistics.median(v) for k, v in times.items()}
            rows.append(
                {
                    "numel": numel,
                    "bits": bits,
                    **{f"{k}_ms": v for k, v in medians.items()},
                    "speedup": medians["expand"] / medians["group"],
                }
            )
            print(rows[-1], flush=True)
    qsgd = get_compressor("qsgd")
    x = torch.randn(235_000)
    compress = [], []
    for _ in range(15):
        started = time.perf_counter()
        payload = qsgd.compress(x)
        compress[0].append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        qsgd.decompress([payload] * 4, x.numel())
        compress[1].append((time.perf_counter() - started) * 1e3)
    result = {
        "threads": 1,
        "round_trip": rows,
        "qsgd_235k": {
            "compress_ms": statistics.median(compress[0]),
            "decompress_4_workers_ms": statistics.median(compress[1]),
        },
        "provenance": stamp.finish(),
    }
    print(result["qsgd_235k"])
    out = results_dir(__file__)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bitpack_speed.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
