"""The Hugging Face Trainer example at equal steps: gradsift's recipe, error feedback alone, the Trainer alone.

    python benchmarks/integrations/hf_trainer.py            # 3 seeds x 3 variants, ~4 min on 2 cores

Each run is ``torchrun --standalone --nproc-per-node 2 examples/hf_trainer_example.py
--steps 300`` (the documented comparison in docs/integrations.md) with ``topk`` at 0.01
(``gradsift``), the same with ``--plain-error-feedback`` (``plain``: the Trainer's AdamW as
built, under error feedback) and ``--without-gradsift`` (``alone``). The result,
``results/integrations/hf_trainer.json``, holds every run's final loss on the example's fixed batch and bytes,
and per variant the mean and sample sd over seeds and the loss ratio to ``alone`` per
seed: the spread ``tests/project/test_examples.py`` takes its margin from.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance stamp, results folder
import provenance
from paths import ROOT, results_dir

SEEDS = (0, 1, 2)
STEPS = 300
NAMED = ["--compressor", "topk", "--ratio", "0.01"]  # the example's default is auto
VARIANTS = {"gradsift": NAMED, "plain": [*NAMED, "--plain-error-feedback"], "alone": ["--without-gradsift"]}


def run(variant: str, seed: int, scratch: Path) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "examples" / "hf_trainer_example.py"), "--steps", str(STEPS), "--save-steps", str(STEPS),
               "--seed", str(seed), "--output-dir", str(scratch / f"{variant}-{seed}"), *VARIANTS[variant]]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=scratch)
    lines = [line for line in done.stdout.splitlines() if line.startswith("gradsift-example ")]
    if done.returncode != 0 or len(lines) != 1:
        raise SystemExit(f"{variant} seed {seed} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[0].removeprefix("gradsift-example "))


def main() -> None:
    stamp = provenance.start(seeds=list(SEEDS))
    runs: dict[str, dict[int, dict]] = {v: {} for v in VARIANTS}
    with tempfile.TemporaryDirectory() as scratch:
        for seed in SEEDS:
            for variant in VARIANTS:
                runs[variant][seed] = run(variant, seed, Path(scratch))
                print(f"{variant} seed {seed}: loss {runs[variant][seed]['loss']:.4f}", flush=True)
    summary = {}
    for variant, by_seed in runs.items():
        losses = [by_seed[s]["loss"] for s in SEEDS]
        ratios = [by_seed[s]["loss"] / runs["alone"][s]["loss"] for s in SEEDS]
        first = by_seed[SEEDS[0]]
        summary[variant] = {
            "loss_mean": statistics.fmean(losses), "loss_sd": statistics.stdev(losses),
            "ratio_to_alone": ratios, "ratio_mean": statistics.fmean(ratios), "ratio_sd": statistics.stdev(ratios),
            "fewer_bytes": first["dense_bytes"] / first["bytes_sent"] if "bytes_sent" in first else 1.0,
        }  # fmt: skip
    result = {
        "steps": STEPS, "compressor": "topk", "ratio": 0.01, "workers": 2,
        "runs": {v: {str(s): r for s, r in by_seed.items()} for v, by_seed in runs.items()},
        "summary": summary, "provenance": stamp.finish(),
    }  # fmt: skip
    (results_dir(__file__) / "hf_trainer.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
