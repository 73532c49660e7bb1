"""More seeds of the VGG curves that ``time_to_target.py`` composes with.

The VGG + SGD curves of the composition are ``benchmarks/training/run_benchmark.py``'s main
grid (4 workers, 200 steps, evaluated every 25), seed 0, run over emulated links; the curve
does not depend on the link (``time_to_target.py`` checks seed 0's 1 Gbit/s and 100 Mbit/s
runs evaluation for evaluation). Issue 42 asks for the candidates' curves over 3 seeds: this
runs more seeds of each fixed candidate on localhost (``--seeds``, default 1 and 2), with the
same flags, into ``results/auto/vgg_seeds/<arm>-s<seed>/`` (summary and evaluations only), and
the stamp of the batch into ``provenance-seeds-<seeds>.json``. Usage (a clean checkout of a
commit on main)::

    flock /tmp/gradsift-cpu.lock python benchmarks/auto/vgg_seeds.py --seeds 1 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance, paths
sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance
from time_to_target import VGG_MORE_SEEDS, VGG_SEED_RUNS, VGG_SEEDS
from whole import run_benchmark, train_flags

#: The fixed candidates ``auto`` chooses among under SGD (``links.py``'s VGG arms).
ARMS = ("none", "bf16", "sidco-exp")
KEPT = ("summary.json", "evals.jsonl")


def train_kept(
    arms: dict[str, list[str]],
    seeds: list[int],
    out: Path,
    extra: tuple[str, ...] = (),
    resume: bool = False,
    workload: str = "vgg",
) -> list[str]:
    """Train ``workload`` (VGG, or a convergence protocol workload) with the composition's flags
    (``train_flags``), then ``arms[arm]`` and ``extra`` (later flags win), once per seed and arm,
    keeping each run's :data:`KEPT` files in ``out/<arm>-s<seed>/``; with ``resume``, a run whose
    summary is there already is skipped. Returns the arms trained, in order (an arm once per seed
    it trained on)."""
    trained = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for arm, flags in arms.items():
                kept = out / f"{arm}-s{seed}"
                if resume and (kept / "summary.json").is_file():
                    print(f"= {kept} (done)", flush=True)
                    continue
                run = Path(tmp) / kept.name
                command = [sys.executable, "-m", "gradsift", "train", *train_flags(workload), "--seed", str(seed),
                           *flags, *extra, "--no-progress", "--out", str(run)]  # fmt: skip
                print("+", " ".join(command), flush=True)
                subprocess.run(command, check=True, timeout=3600)
                kept.mkdir(parents=True, exist_ok=True)
                for name in KEPT:
                    shutil.copy(run / name, kept / name)
                trained.append(arm)
    return trained


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), help="compressors (default: %(default)s)")
    parser.add_argument(
        "--out", type=Path, default=VGG_SEED_RUNS, help="where the runs go (default: %(default)s)"
    )
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=[1, 2], help="seeds to run, of %(choices)s (default: %(default)s)",
        choices=[s for s in (*VGG_SEEDS, *VGG_MORE_SEEDS) if s != 0],
    )  # fmt: skip
    args = parser.parse_args(argv)
    seeds = args.seeds
    stamp = provenance.start(seeds=seeds)
    train_kept(
        {arm: ["--compressor", arm, *run_benchmark.COMPRESSORS[arm]] for arm in args.arms}, seeds, args.out
    )
    stamp_path = args.out / f"provenance-seeds-{'-'.join(map(str, seeds))}.json"
    stamp_path.write_text(json.dumps(stamp.finish(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
