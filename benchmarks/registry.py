"""Every number that README.md and docs/ quote from a benchmark result, and its source.

Each :class:`~claimmodel.Claim` names its result file, the field path(s) in it, the
format and -- through its :class:`~claimmodel.Result` -- the command that made the file.
``claims.py --write`` puts them into the docs between ``<!-- claim:<id> -->`` markers (and
whole tables between ``<!-- claims-table:<name> -->`` markers); ``claims.py --check`` and
``tests/project/test_claims.py`` fail when a published number is not what its file says. A number
a result file cannot back is not published. ``python benchmarks/claims.py --list`` prints
the registry with the current values.
"""

from __future__ import annotations

import functools
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from claimmodel import Cell, Claim, Result, Table, ratio, spanned

# -- results ------------------------------------------------------------------------------
ESTIMATION = "python benchmarks/estimation/run.py"
EST = Result("results/estimation/results.json", ESTIMATION)
EST_STAT = Result(
    "results/estimation/results-statistical.json",
    f"{ESTIMATION} --exact-below 0 --out results/estimation/results-statistical.json "
    "--plot results/estimation/summary-statistical.png",
)
EST_PLAIN = Result(
    "results/estimation/results-plain.json",
    f"{ESTIMATION} --no-adapt --out results/estimation/results-plain.json "
    "--plot results/estimation/summary-plain.png",
)
EST_16K = Result(
    "results/estimation/results-sample16k.json",
    f"{ESTIMATION} --sample-size 16384 --exact-below 0 --out results/estimation/results-sample16k.json "
    "--plot results/estimation/summary-sample16k.png",
)
COMPRESS = Result(
    "results/compress/results.json",
    "flock /tmp/gradsift-cpu.lock gradsift bench compress --sizes 25000000 --ratios 0.1 0.01 0.001 "
    "--threads 2 --repeats 5 --warmup 3 --json results/compress/results.json",
)
TRAINING_COMMAND = "flock /tmp/gradsift-cpu.lock python benchmarks/training/run_benchmark.py"
TRAINING = Result("results/training/results.json", TRAINING_COMMAND)
VGC_ACCURACY = Result(
    "results/vgc/accuracy.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/vgc/accuracy.py --out results/vgc/accuracy.json",
)
VGC_HOOKS = Result(
    "results/vgc/hook_overhead.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/vgc/hook_overhead.py --batch 32 --repeats 30 "
    "--threads 1 --out results/vgc/hook_overhead.json",
)
HOOK = Result(
    "results/hook_overhead/results.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/hook_overhead/run.py --steps 200 --warmup 10 "
    "--profile-steps 10 --json results/hook_overhead/results.json",
)
DDP = Result(
    "results/ddp/results.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/ddp/bench_hook.py --world-sizes 2 4 --steps 40 --warmup 3 "
    "--out results/ddp/results.json",
)
SCALING = Result("results/scaling/analysis.json", ".venv/bin/python benchmarks/scaling/analyze.py")
PREDICTIONS = Result("results/scaling/predictions.json", ".venv/bin/python benchmarks/scaling/predict.py")


def training_run(name: str) -> Result:
    """One run's summary.json under results/training/runs/ (written by the same command)."""
    return Result(f"results/training/runs/{name}/summary.json", TRAINING_COMMAND)


def load_claim(claim_id: str, result: Result, fmt: str = "{:.1f} / {:.1f}") -> Claim:
    """The 1-minute load average before and after the run, from its provenance stamp."""
    return Claim(
        claim_id, result, ("provenance/load_before/0", "provenance/load_after/0"), fmt, compute=lambda *v: v
    )


QUANTIZERS = Result(
    "results/quantizers/compare.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/quantizers/compare.py --json results/quantizers/compare.json",
)
SIDCO_RUN, TOPK_RUN = training_run("sidco-exp-w4-100mbit"), training_run("topk-w4-100mbit")


def interval_claim(
    claim_id: str, result: Result, path: str, spec: str, unit: str = "", counted: bool = False
) -> Claim:
    """A paired comparison at ``path`` (keys ``mean``, ``low``, ``high``): the mean and its 95 %
    interval, each formatted with ``spec`` then ``unit``; the mean alone where one seed gave no
    interval, "none reached" where no seed gave a value. ``counted``: the comparison also holds
    ``per_seed`` (None where a seed gave no value) and ``n`` (the seeds that did), and a mean over
    fewer than all the seeds says over how many."""
    ends = ("mean", "low", "high", *(("n", "per_seed") if counted else ()))
    fields = tuple(f"{path}/{end}" for end in ends)

    def text(
        mean: float | None, low: float | None, high: float | None, n: int = 0, per_seed: Sequence[Any] = ()
    ) -> str | None:
        if mean is None:
            return None
        shown = (
            f"{mean:{spec}}{unit} (one seed)"
            if low is None or high is None
            else f"{mean:{spec}}{unit} [{low:{spec}}, {high:{spec}}]"
        )
        return f"{shown} ({n} of {len(per_seed)} seeds)" if counted and 1 < n < len(per_seed) else shown

    return Claim(claim_id, result, fields, compute=text, missing="none reached")


# -- estimation quality ----------------------------------------------------------------------
MEDIAN_IN, P10_P90_IN, CASES = "summary/median_in_0.8_1.25", "summary/p10_p90_in_0.5_2", "summary/cases"
ESTIMATION_CLAIMS = (
    Claim("est.cases", EST, (CASES,)),
    Claim("est.statistical.median_in", EST_STAT, (MEDIAN_IN, CASES), "{}/{}", compute=lambda *v: v),
    Claim("est.statistical.range", EST_STAT, ("summary/worst_median",), compute=spanned(".3f")),
    Claim("est.statistical.p10p90_in", EST_STAT, (P10_P90_IN, CASES), "{}/{}", compute=lambda *v: v),
    Claim("est.default.range", EST, ("summary/worst_median",), compute=spanned(".3f")),
    Claim("est.plain.median_in", EST_PLAIN, (MEDIAN_IN, CASES), "{}/{}", compute=lambda *v: v),
    Claim("est.sample16k.median_in", EST_16K, (MEDIAN_IN, CASES), "{}/{}", compute=lambda *v: v),
    Claim("est.sample16k.p10p90_in", EST_16K, (P10_P90_IN, CASES), "{}/{}", compute=lambda *v: v),
)

EST_RUNS = (
    (
        "default (sample 2^18; every tensor here is under `exact_below` = 2^19: the exact top-k)",
        "default",
        EST,
    ),
    ("`--exact-below 0` (the statistical path on every tensor, sample 2^18)", "statistical", EST_STAT),
    ("`--sample-size 16384 --exact-below 0` (subsampled statistical path)", "sample16k", EST_16K),
    ("`--no-adapt` (the paper's plain fitted threshold, 2 stages, every size)", "plain", EST_PLAIN),
)
ESTIMATION_TABLE = Table(
    "estimation-runs",
    ("run", "medians in [0.8, 1.25]", "p10..p90 in [0.5, 2]", "worst median", "worst p10 / p90"),
    ("---", "---:", "---:", "---:", "---:"),
    tuple(
        (label, Claim(f"esttab.{name}.median_in", result, (MEDIAN_IN, CASES), "{}/{}", compute=lambda *v: v),
         Claim(f"esttab.{name}.p10p90_in", result, (P10_P90_IN, CASES), "{}/{}", compute=lambda *v: v),
         Claim(f"esttab.{name}.worst_median", result, ("summary/worst_median",), "{:.3f} .. {:.3f}",
               compute=lambda v: tuple(v)),
         Claim(f"esttab.{name}.worst_p10p90", result, ("summary/worst_p10_p90",), "{:.3g} / {:.3g}",
               compute=lambda v: tuple(v)))
        for label, name, result in EST_RUNS
    ),
)  # fmt: skip
EST_SPEED = Result(
    "results/estimation/speed.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/estimation/speed.py --repeat 15 --json results/estimation/speed.json",
)
EST_SPEED_ROWS = (("`torch.linalg.vector_norm(x, 1)`", "read_pass_l1"), ("`torch.topk(x.abs(), k)`", "topk"),
                  *((name, name) for name in ("sidco-exp", "sidco-gpareto", "sidco-gamma")))  # fmt: skip


def _speed_row(label: str, key: str) -> tuple[Cell, ...]:
    """One method's row of speed.json: its median, in read passes, and over torch.topk (SIDCo's)."""
    over_topk: Cell = "1" if key == "topk" else "-"
    if key.startswith("sidco"):
        over_topk = Claim(f"estspeed.{key}.speedup", EST_SPEED, (f"topk_speedup/{key}",), "{:.1f}")
    return (
        label,
        Claim(f"estspeed.{key}.ms", EST_SPEED, (f"median_ms/{key}",), "{:.1f}"),
        Claim(f"estspeed.{key}.passes", EST_SPEED, (f"x_read_pass/{key}",), "{:.2f}"),
        over_topk,
    )


EST_SPEED_TABLE = Table(
    "estimation-speed",
    ("method", "median ms", "x one read pass (L1 norm)", "speed-up over torch.topk"),
    ("---", "---:", "---:", "---:"),
    tuple(_speed_row(label, key) for label, key in EST_SPEED_ROWS),
)
EST_SPEED_CLAIMS = (
    Claim("estspeed.commit", EST_SPEED, ("provenance/commit",), "{:.7}"),
    load_claim("estspeed.load", EST_SPEED),
)

# -- cost of selection (25M elements) ---------------------------------------------------------
SIDCO_01 = "rows/{compressor^=sidco,ratio=0.01}"
COMPRESS_CLAIMS = (
    Claim("compress.floor", COMPRESS, ("rows/[compressor=topk,ratio=0.01]/floor_ms",), "{:.1f} ms"),
    Claim("compress.topk", COMPRESS, ("rows/[compressor=topk,ratio=0.01]/topk_ms",), "{:.0f} ms"),
    Claim("compress.sidco.ms", COMPRESS, (f"{SIDCO_01}/compress_ms",), "{} ms", compute=spanned(".1f")),
    Claim("compress.sidco.passes", COMPRESS, (f"{SIDCO_01}/compress_vs_floor",), compute=spanned(".2f")),
    Claim(
        "compress.sidco.speedup", COMPRESS, (f"{SIDCO_01}/speedup_vs_topk",), "{}x", compute=spanned(".1f")
    ),
    Claim("compress.sidco.count", COMPRESS, (f"{SIDCO_01}/count_vs_target",), "{}x", compute=spanned(".3f")),
    Claim("compress.dgc.ms", COMPRESS, ("rows/[compressor=dgc,ratio=0.01]/compress_ms",), "{:.0f} ms"),
    Claim("compress.dgc.speedup", COMPRESS, ("rows/[compressor=dgc,ratio=0.01]/speedup_vs_topk",), "{:.1f}x"),
    Claim(
        "compress.redsync.ms", COMPRESS, ("rows/[compressor=redsync,ratio=0.01]/compress_ms",), "{:.0f} ms"
    ),
    Claim(
        "compress.gaussiank.ms",
        COMPRESS,
        ("rows/[compressor=gaussiank,ratio=0.01]/compress_ms",),
        "{:.0f} ms",
    ),
    Claim(
        "compress.sidco.other_ratios",
        COMPRESS,
        (
            "rows/{compressor^=sidco,ratio=0.1}/speedup_vs_topk",
            "rows/{compressor^=sidco,ratio=0.001}/speedup_vs_topk",
        ),
        "{}x",
        compute=spanned(".1f"),
    ),
    Claim("compress.commit", COMPRESS, ("provenance/commit",), "{:.7}"),
    Claim(
        "compress.topk_compressor.ms",
        COMPRESS,
        ("rows/[compressor=topk,ratio=0.01]/compress_ms",),
        "{:.0f} ms",
    ),
    Claim(
        "compress.sidco.vs_topk_compressor",
        COMPRESS,
        (f"{SIDCO_01}/speedup_vs_topk_compressor",),
        "{}x",
        compute=spanned(".1f"),
    ),
    Claim(
        "compress.bare.passes",
        COMPRESS,
        ("rows/{compressor=topk}/topk_ms", "rows/{compressor=topk}/floor_ms"),
        compute=lambda topk, floor: spanned(".0f")(*(t / f for t, f in zip(topk, floor, strict=True))),
    ),
    Claim(
        "compress.topk_compressor.passes",
        COMPRESS,
        ("rows/{compressor=topk}/compress_vs_floor",),
        compute=spanned(".0f"),
    ),
    Claim(
        "compress.load",
        COMPRESS,
        ("provenance/load_before/0", "provenance/load_after/0"),
        "{:.1f} before, {:.1f} after",
        compute=lambda before, after: (before, after),
    ),
)

# -- training over emulated links (VGG, 4 workers, 200 steps) ---------------------------------
GBIT = "bandwidths/1gbit"


def row(compressor: str, key: str, link: str) -> str:
    return f"{link}/rows/[compressor={compressor}]/{key}"


def _scaled(compressor: str, workers: int, field: str) -> Claim:
    """A step time of the training benchmark's scaling runs (100 Mbit/s), in ms."""
    return Claim(f"train.scaling.{compressor}.w{workers}.{field}", TRAINING,
                 (f"scaling/rows/[compressor={compressor},workers={workers}]/{field}_step_s",), "{:.0f} ms",
                 compute=lambda s: 1e3 * s)  # fmt: skip


TRAINING_SCALING_TABLE = Table(
    "training-scaling",
    ("workers", "none measured", "none predicted", "sidco-exp measured", "sidco-exp predicted"),
    ("---:", "---:", "---:", "---:", "---:"),
    tuple(
        (str(w), *(_scaled(c, w, f) for c in ("none", "sidco-exp") for f in ("measured", "predicted")))
        for w in (2, 4, 8)
    ),
)
SPARSE, DENSE = ("sidco-exp", "topk"), ("none", "bf16")
TRAINING_CLAIMS = (
    Claim("train.crossover", TRAINING, ("scaling/crossover_workers",), "{}"),
    Claim("train.1gbit.step", TRAINING, tuple(row(c, "step_ms", GBIT) for c in (*DENSE, *SPARSE)), "{} ms",
          compute=spanned(".0f")),
    Claim("train.sidco.compress", SIDCO_RUN, ("compress_median_s",), "{:.1f} ms", compute=lambda s: 1e3 * s),
    Claim("train.topk.compress", TOPK_RUN, ("compress_median_s",), "{:.1f} ms", compute=lambda s: 1e3 * s),
    Claim("train.sidco.compute", SIDCO_RUN, ("compute_median_s",), "{:.0f} ms", compute=lambda s: 1e3 * s),
    Claim("train.commit", TRAINING, ("provenance/commit",), "{:.7}"),
)  # fmt: skip

# -- the training benchmark over seeds (VGG, 100 Mbit/s: the main grid's five arms) -----------
TRAINING_SEEDS = Result(
    "results/training/seeds.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/training/seeds.py --json results/training/seeds.json",
)
TRAINING_SEED_ARMS = (("`none` (fp32 allreduce)", "none"), ("`bf16` allreduce", "bf16"),
                      ("`sidco-exp` at 0.01, DGC's recipe", "sidco-exp"), ("`topk` at 0.01, DGC's recipe", "topk"),
                      ("`vgc` (alpha 1, zeta 0.999)", "vgc"))  # fmt: skip


def _per_seed(values: list[float | None], spec: str) -> str:
    """A list over the seeds, ``-`` where a seed gave no value."""
    return ", ".join("-" if v is None else format(v, spec) for v in values)


def _training_seed_cells(label: str, arm: str) -> tuple[Cell, ...]:
    """One arm's row of the seeded verdict table."""
    paired = arm != "none"
    return (
        label,
        Claim(f"trainseeds.{arm}.bytes", TRAINING_SEEDS,
              tuple(f"arms/{arm}/bytes_{way}_per_step" for way in ("sent", "received")), "{:,.0f} / {:,.0f}",
              compute=lambda *v: v),
        Claim(f"trainseeds.{arm}.step", TRAINING_SEEDS, (f"arms/{arm}/step_time_median_s",), "{:.0f} ms",
              compute=lambda v: 1e3 * v),
        Claim(f"trainseeds.{arm}.times", TRAINING_SEEDS, (f"arms/{arm}/time_to_target_s",),
              compute=lambda v: _per_seed(v, ".1f")),
        *(interval_claim(f"trainseeds.{arm}.sooner.{base}", TRAINING_SEEDS, f"arms/{arm}/sooner_than/{base}", ".2f",
                         "x", counted=True) if paired and base != arm else "-" for base in ("none", "bf16")),
        Claim(f"trainseeds.{arm}.accuracy", TRAINING_SEEDS, (f"arms/{arm}/final_test_accuracy",),
              compute=lambda v: _per_seed(v, ".4f")),
        interval_claim(f"trainseeds.{arm}.points", TRAINING_SEEDS, f"arms/{arm}/points_vs_none", "+.2f")
        if paired else "-",
    )  # fmt: skip


def _seeded_step_ratio(slow: str, fast: str, spec: str) -> Claim:
    """``slow``'s median step over ``fast``'s (the medians over the seeds)."""
    return Claim(f"trainseeds.step.{slow}_over_{fast.split('-')[0]}", TRAINING_SEEDS,
                 (f"arms/{slow}/step_time_median_s", f"arms/{fast}/step_time_median_s"), f"{{:{spec}}}x",
                 compute=ratio)  # fmt: skip


TRAINING_SEEDS_TABLE = Table(
    "training-seeds",
    ("arm (VGG, 4 workers, 200 steps, 100 Mbit/s)", "bytes sent / received per step and worker", "step (median)",
     "time to the target per seed (s)", "sooner than fp32 (paired, 95 % CI)", "sooner than bf16 (paired, 95 % CI)",
     "final accuracy per seed", "vs fp32 (points, paired, 95 % CI)"),
    ("---", "---:", "---:", "---:", "---:", "---:", "---:", "---:"),
    tuple(_training_seed_cells(label, arm) for label, arm in TRAINING_SEED_ARMS),
)  # fmt: skip
TRAINING_SEEDS_CLAIMS = (
    Claim("trainseeds.commit", TRAINING_SEEDS, ("provenance/commit",), "{:.7}"),
    load_claim("trainseeds.load", TRAINING_SEEDS),
    Claim("trainseeds.targets", TRAINING_SEEDS, ("targets",), compute=lambda t: _per_seed(list(t.values()), ".4f")),
    interval_claim("trainseeds.sidco.sooner.none", TRAINING_SEEDS, "arms/sidco-exp/sooner_than/none", ".1f", "x"),
    interval_claim("trainseeds.sidco.sooner.bf16", TRAINING_SEEDS, "arms/sidco-exp/sooner_than/bf16", ".1f", "x"),
    interval_claim("trainseeds.sidco.points", TRAINING_SEEDS, "arms/sidco-exp/points_vs_none", "+.2f"),
    Claim("trainseeds.sidco.factor", TRAINING_SEEDS, ("arms/sidco-exp/compression_factor",), "{:.0f}x"),
    Claim("trainseeds.sparse.step", TRAINING_SEEDS, tuple(f"arms/{arm}/step_time_median_s" for arm in ("sidco-exp", "topk")),
          "{} ms", compute=spanned(".0f", scale=1e3)),
    *(_seeded_step_ratio(slow, fast, spec) for slow, fast, spec in (
        ("none", "sidco-exp", ".1f"), ("bf16", "sidco-exp", ".1f"), ("topk", "sidco-exp", ".2f"), ("none", "vgc", ".1f"))),
)  # fmt: skip


# -- VGC: accuracy and bytes (VGG, one epoch), variance-hook overhead ---------------------------
VGC_RUNS = {"vgc1": "vgc alpha=1", "vgc2": "vgc alpha=2", "vgc4": "vgc alpha=4",
            "sidco": "sidco-exp matched", "topk": "topk matched", "vgc0": "vgc alpha=0", "topkdense": "topk ratio=1",
            "alone": "alone"}  # fmt: skip


def vgc_points(claim_id: str, run: str, spec: str) -> Claim:
    """Run ``run``'s test accuracy against fp32's in points, paired per seed."""
    return interval_claim(claim_id, VGC_ACCURACY, f"runs/{run}/points_vs_fp32", spec)


VGC_CLAIMS = (
    Claim("vgc.fp32.accuracy", VGC_ACCURACY, ("runs/none/final_test_accuracy",), "{:.4f}"),
    Claim("vgc.fp32.accuracy3", VGC_ACCURACY, ("runs/none/final_test_accuracy",), "{:.3f}"),
    Claim("vgc.vgc1.accuracy3", VGC_ACCURACY, ("runs/vgc alpha=1/final_test_accuracy",), "{:.3f}"),
    *(
        Claim(f"vgc.{key}.fewer", VGC_ACCURACY, (f"runs/{VGC_RUNS[key]}/fewer_bytes_than_fp32",), spec)
        for key, spec in (("vgc1", "{:.1f}x"), ("vgc2", "{:.0f}x"), ("vgc4", "{:.0f}x"))
    ),
    *(
        Claim(f"vgc.{key}.density", VGC_ACCURACY, (f"runs/{name}/achieved_density",), "{:.1f}%",
              compute=lambda d: 100 * d)
        for key, name in VGC_RUNS.items() if key in ("vgc1", "vgc2", "vgc4")
    ),
    # test accuracy against fp32's, in points (negative: lower accuracy), paired over the seeds
    *(vgc_points(f"vgc.{key}.points", VGC_RUNS[key], spec) for key, spec in
      (("vgc1", "+.2f"), ("vgc2", "+.1f"), ("vgc4", "+.1f"), ("sidco", "+.2f"), ("topk", "+.2f"), ("vgc0", "+.2f"),
       ("topkdense", "+.2f"), ("alone", "+.1f"))),
)  # fmt: skip
VGC_ACCURACY_ROWS = (("none (fp32)", "none"), ("bf16", "bf16"), ("vgc alpha=1", "vgc alpha=1"),
                     ("vgc alpha=2", "vgc alpha=2"), ("vgc alpha=4", "vgc alpha=4"),
                     ("`sidco-exp`, alpha=2's bytes", "sidco-exp matched"), ("`topk`, alpha=2's bytes", "topk matched"),
                     ("control: vgc alpha=0 (no variance test)", "vgc alpha=0"),
                     ("control: `topk` ratio=1 (the recipe run dense)", "topk ratio=1"),
                     ("control: one worker alone, no communication", "alone"))  # fmt: skip
VGC_ACCURACY_TABLE = Table(
    "vgc-accuracy",
    ("run", "bytes sent / received per step and worker", "fewer bytes than fp32", "density",
     "median step (localhost)", "test accuracy after 1 epoch (mean)", "vs fp32 (points, paired, 95 % CI)"),
    ("---", "---:", "---:", "---:", "---:", "---:", "---:"),
    tuple(
        (label,
         Claim(f"vgcacc.{run}.bytes", VGC_ACCURACY,
               (f"runs/{run}/bytes_sent_per_step", f"runs/{run}/bytes_received_per_step"), "{:,.0f} / {:,.0f}",
               compute=lambda *v: v),
         Claim(f"vgcacc.{run}.fewer", VGC_ACCURACY, (f"runs/{run}/fewer_bytes_than_fp32",), "{:.1f}x", missing="-"),
         Claim(f"vgcacc.{run}.density", VGC_ACCURACY, (f"runs/{run}/achieved_density",), "{:.4f}"),
         Claim(f"vgcacc.{run}.step", VGC_ACCURACY, (f"runs/{run}/step_time_median_s",), "{:.0f} ms",
               compute=lambda s: 1e3 * s),
         Claim(f"vgcacc.{run}.accuracy", VGC_ACCURACY, (f"runs/{run}/final_test_accuracy",), "{:.4f}"),
         vgc_points(f"vgcacc.{run}.points", run, "+.2f") if run != "none" else "-")
        for label, run in VGC_ACCURACY_ROWS
    ),
)  # fmt: skip
VGC_HOOKS_MODELS = (("mlp", "mlp"), ("vgg", "vgg"), ("lstm, Linear cells", "lstm"))


def _vgc_hook_cell(model: str, rule: str) -> Claim:
    return Claim(f"vgchooks.{model}.{rule}", VGC_HOOKS,
                 (f"results/{model}/median_backward_ms/hooks-{rule}-conv",
                  f"results/{model}/backward_ratio_to_plain/hooks-{rule}-conv"),
                 "{:.2f} ms ({:.2f}x)", compute=lambda *v: v)  # fmt: skip


VGC_HOOKS_TABLE = Table(
    "vgc-hooks",
    ("model (params)", "plain backward", "hooks, approx conv", "hooks, exact conv",
     "forward+backward ratio (approx / exact)"),
    ("---", "---:", "---:", "---:", "---:"),
    tuple(
        (Claim(f"vgchooks.{model}.label", VGC_HOOKS, (f"results/{model}/parameters",), label + " ({})",
               compute=lambda n: f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"),
         Claim(f"vgchooks.{model}.plain", VGC_HOOKS, (f"results/{model}/median_backward_ms/plain",), "{:.2f} ms"),
         _vgc_hook_cell(model, "approx"),
         _vgc_hook_cell(model, "exact"),
         Claim(f"vgchooks.{model}.fwdbwd", VGC_HOOKS,
               (f"results/{model}/forward_backward_ratio_to_plain/hooks-approx-conv",
                f"results/{model}/forward_backward_ratio_to_plain/hooks-exact-conv"),
               "{:.2f}x / {:.2f}x", compute=lambda *v: v))
        for label, model in VGC_HOOKS_MODELS
    ),
)  # fmt: skip
VGC_STAMP_CLAIMS = (
    Claim("vgchooks.commit", VGC_HOOKS, ("provenance/commit",), "{:.7}"),
    Claim("vgchooks.load", VGC_HOOKS, ("provenance/load_before/0", "provenance/load_after/0"),
          "{:.2f} before, {:.2f} after", compute=lambda *v: v),
    Claim("vgcacc.commit", VGC_ACCURACY, ("provenance/commit",), "{:.7}"),
    load_claim("vgcacc.load", VGC_ACCURACY),
    Claim("vgcacc.matched_ratio", VGC_ACCURACY, ("matched_ratio",), "{:.4f}"),
)  # fmt: skip
PADDING = {
    model: Result(f"results/vgc/padding-{model}.json",
                  f"flock /tmp/gradsift-cpu.lock python benchmarks/vgc/padding.py --model {model} --steps {steps} "
                  f"--json results/vgc/padding-{model}.json")
    for model, steps in (("mlp", 600), ("vgg", 200))
}  # fmt: skip
PADDING_CLAIMS = tuple(
    Claim(f"padding.{model}.{short}", result,
          (f"results/{label}/padded_over_sent_mean", f"results/{label}/padded_over_sent_sd", "args/seeds"),
          "{:.2f}x +- {:.2f} ({} seeds)", compute=lambda mean, sd, seeds: (mean, sd, len(seeds)))
    for model, result in PADDING.items()
    for short, label in (("vgc", "vgc-alpha4"), ("threshold", "threshold-0.1"))
)  # fmt: skip
PADDING_ARMS = (
    ("fp32 (`none`)", "fp32"),
    ("`bf16`", "bf16"),
    ("one worker alone, no communication", "alone"),
    ("VGC alpha 4", "vgc-alpha4"),
    ("VGC alpha 4, `padding_target=1.1`", "vgc-alpha4-padding1.1"),
    ("VGC alpha 6", "vgc-alpha6"),
    ("`threshold` 0.1", "threshold-0.1"),
)
PADDING_TABLE = Table(
    "vgc-padding",
    ("model", "configuration", "padded / sent", "kB on the wire per step", "test accuracy"),
    ("---", "---", "---:", "---:", "---:"),
    tuple(
        (model, name,
         "-" if label == "alone" else  # nothing sent, nothing padded
         Claim(f"padtab.{model}.{label}.ratio", result,
               (f"results/{label}/padded_over_sent_mean", f"results/{label}/padded_over_sent_sd"), "{:.2f} ± {:.2f}",
               compute=lambda mean, sd: (mean, sd)),
         Claim(f"padtab.{model}.{label}.kb", result, (f"results/{label}/bytes_padded_per_step_mean",), "{:.1f}",
               compute=lambda b: b / 1000),
         Claim(f"padtab.{model}.{label}.accuracy", result,
               (f"results/{label}/accuracy_mean", f"results/{label}/accuracy_sd"), "{:.3f} ± {:.3f}",
               compute=lambda mean, sd: (mean, sd)))
        for model, result in PADDING.items() for name, label in PADDING_ARMS
    ),
)  # fmt: skip
HOOK_MODELS = ("mlp", "vgg", "lstm")
VGC_HOOK_CLAIMS = (
    Claim("vgc.hooks.backward", VGC_HOOKS, ("results/*/backward_ratio_to_plain/hooks-approx-conv",), "{}x",
          compute=spanned(".2f")),
    *(
        Claim(f"vgc.hooks.{model}.{kind}.{rule}", VGC_HOOKS, (f"results/{model}/{kind}_ratio_to_plain/hooks-{rule}-conv",),
              "{:.2f}x")
        for model in HOOK_MODELS for kind in ("backward", "forward_backward") for rule in ("approx", "exact")
        if rule == "approx" or model == "vgg"  # the exact rule differs from the approximate one on convolutions only
    ),
)  # fmt: skip

HOOK_CONFIGS = (("stock DDP", "stock"), ("PyTorch's `allreduce_hook`", "torch-allreduce-hook"),
                ("PyTorch's C++ built-in `ALLREDUCE` hook", "torch-builtin-hook"), ("`none`", "none"),
                ("`sidco-exp@0.01`", "sidco-exp@0.01"), ("`topk@0.01`", "topk@0.01"),
                ("`auto` (the one line)", "auto"))  # fmt: skip
#: Issue 13's targets, and issue 42's for the one line on a fast link; fixed before the runs.
HOOK_TARGETS = {"none": 1.03, "sidco-exp@0.01": 1.3, "auto": 1.05}


def hook_ratio(config: str) -> Claim:
    """The configuration's step over stock DDP's, with its target's verdict where it has one."""
    target = HOOK_TARGETS.get(config)
    verdict = (lambda r: f"{r:.3f}x") if target is None else (  # 3 decimals: the targets sit within percents
        lambda r: f"**{r:.3f}x** (target {target}x: {'met' if r <= target else 'not met'})")  # fmt: skip
    return Claim(f"hook.{config}.ratio", HOOK, (f"results/{config}/ratio_to_stock",), compute=verdict)


def hook_phases(config: str) -> Cell:
    keys = tuple(f"results/{config}/median_{phase}_ms" for phase in ("compress", "communicate", "decompress"))
    return "-" if config in ("stock", "torch-allreduce-hook", "torch-builtin-hook") else Claim(f"hook.{config}.phases", HOOK, keys, "{:.1f} / {:.1f} / {:.1f}",
                                                compute=lambda *v: v)  # fmt: skip


HOOK_TABLE = Table(
    "hook-overhead",
    ("configuration", "median step", "vs stock DDP", "compress / communicate / decompress ms (telemetry medians)"),
    ("---", "---:", "---:", "---"),
    tuple(
        (label, Claim(f"hook.{config}.step", HOOK, (f"results/{config}/median_step_ms",), "{:.1f} ms"),
         hook_ratio(config), hook_phases(config))
        for label, config in HOOK_CONFIGS
    ),
)  # fmt: skip
HOOK_REPEAT = Result(
    "results/hook_overhead/repeat.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/hook_overhead/run.py --steps 200 --warmup 10 "
    "--profile-steps 0 --json results/hook_overhead/repeat.json",
)
#: The same two runs on a later commit, on a slower afternoon (the machine's state, not the code: see the README).
HOOK_AFTERNOON = tuple(
    Result(f"results/hook_overhead/afternoon{suffix}.json",
           f"flock /tmp/gradsift-cpu.lock python benchmarks/hook_overhead/run.py --steps 200 --warmup 10 "
           f"--profile-steps {profile} --json results/hook_overhead/{'repeat' if suffix else 'results'}.json "
           f"(a clean worktree of bf06bf2; committed as afternoon{suffix}.json)")
    for suffix, profile in (("", 10), ("-repeat", 0))
)  # fmt: skip

#: The run again on 6 December, after the CPU top-k became a radix select (5 December).
HOOK_RADIX_TOPK = Result(
    "results/hook_overhead/radix-topk.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/provenance.py --json results/hook_overhead/results.json -- "
    "python benchmarks/hook_overhead/run.py --steps 200 --warmup 10 --profile-steps 10 "
    "--json results/hook_overhead/results.json (a clean worktree of 437b523; committed as radix-topk.json)",
)
HOOK_RADIX_TOPK_CLAIMS = (
    Claim("hook.radix.commit", HOOK_RADIX_TOPK, ("provenance/commit",), "{:.7}"),
    Claim("hook.radix.stock", HOOK_RADIX_TOPK, ("results/stock/median_step_ms",), "{:.1f} ms"),
    *(
        Claim(f"hook.radix.{label}", HOOK_RADIX_TOPK, (f"results/{label}/ratio_to_stock",), "{:.3f}x")
        for label in ("topk@0.01", "sidco-exp@0.01", "none", "auto")
    ),
    Claim(
        "hook.radix.topk.compress", HOOK_RADIX_TOPK, ("results/topk@0.01/median_compress_ms",), "{:.1f} ms"
    ),
    Claim(
        "hook.radix.sidco.compress",
        HOOK_RADIX_TOPK,
        ("results/sidco-exp@0.01/median_compress_ms",),
        "{:.1f} ms",
    ),
)

#: The same two runs again on the evening of 3 December, on c427f0d (after the adaptive-capacity change).
HOOK_EVENING = tuple(
    Result(f"results/hook_overhead/evening{suffix}.json",
           f"flock /tmp/gradsift-cpu.lock python benchmarks/hook_overhead/run.py --steps 200 --warmup 10 "
           f"--profile-steps {profile} --json /tmp/{name}.json "
           f"(a clean worktree of c427f0d; committed as evening{suffix}.json)")
    for suffix, profile, name in (("", 10, "ho2"), ("-repeat", 0, "ho"))
)  # fmt: skip


def _five_hook_runs(stem: str) -> tuple[Result, ...]:
    """Five back-to-back runs of the hook benchmark without the profile, ``results/hook_overhead/<stem>-<n>.json``."""
    return tuple(
        Result(f"results/hook_overhead/{stem}-{run}.json",
               f"flock /tmp/gradsift-cpu.lock python benchmarks/hook_overhead/run.py --steps 200 --warmup 10 "
               f"--profile-steps 0 --json results/hook_overhead/{stem}-{run}.json")
        for run in range(1, 6)
    )  # fmt: skip


def _run_ratios(runs: tuple[Result, ...], config: str) -> tuple[str | tuple[Result, str], ...]:
    """One configuration's step over stock DDP's in each of ``runs`` (claim fields, read from ``runs[0]`` on)."""
    path = f"results/{config}/ratio_to_stock"
    return (path, *((result, path) for result in runs[1:]))


#: Five runs the night of 3 December, on 9c9ed43: the run-to-run spread.
HOOK_SPREAD = _five_hook_runs("spread")
#: Five runs at the README verdict's commit: its fast-link row.
HOOK_VERDICT = _five_hook_runs("verdict")


def _verdict_hook_cost(config: str) -> Claim:
    """``config``'s step over stock DDP's: the median of :data:`HOOK_VERDICT`'s five runs and their range."""
    return Claim(f"hookverdict.{config}", HOOK_VERDICT[0], _run_ratios(HOOK_VERDICT, config), "{:.3f}x ({:.3f}-{:.3f}x)",
                 compute=lambda *ratios: (statistics.median(ratios), min(ratios), max(ratios)))  # fmt: skip


HOOK_VERDICT_CLAIMS = (
    Claim("hookverdict.commit", HOOK_VERDICT[0], ("provenance/commit",), "{:.7}"),
    Claim("hookverdict.load", HOOK_VERDICT[0], ("provenance/load_before/0", (HOOK_VERDICT[-1], "provenance/load_after/0")),
          "{:.1f} / {:.1f}", compute=lambda *v: v),
    _verdict_hook_cost("auto"),
)  # fmt: skip
#: The spread table's columns: (heading, configuration in the run's results).
SPREAD_COLUMNS = (
    ("PyTorch's C++ `ALLREDUCE` hook", "torch-builtin-hook"),
    ("PyTorch's Python `allreduce_hook`", "torch-allreduce-hook"),
    ("`none`", "none"),
    ("`sidco-exp@0.01`", "sidco-exp@0.01"),
)


def _spread_median(config: str) -> Claim:
    """The median over the five runs of one configuration's step over stock DDP's."""
    return Claim(f"hookspread.median.{config}", HOOK_SPREAD[0], _run_ratios(HOOK_SPREAD, config), "{:.3f}x",
                 compute=lambda *ratios: statistics.median(ratios))  # fmt: skip


HOOK_SPREAD_TABLE = Table(
    "hook-spread",
    ("run", "stock DDP step", *(heading for heading, _ in SPREAD_COLUMNS)),
    ("---:", "---:", *("---:" for _ in SPREAD_COLUMNS)),
    (
        *((str(run), Claim(f"hookspread.{run}.stock", result, ("results/stock/median_step_ms",), "{:.1f} ms"),
           *(Claim(f"hookspread.{run}.{config}", result, (f"results/{config}/ratio_to_stock",), "{:.3f}x")
             for _, config in SPREAD_COLUMNS))
          for run, result in enumerate(HOOK_SPREAD, start=1)),
        ("median", "-", *(_spread_median(config) for _, config in SPREAD_COLUMNS)),
    ),
)  # fmt: skip

HOOK_SPREAD_CLAIMS = (
    Claim("hookspread.commit", HOOK_SPREAD[0], ("provenance/commit",), "{:.7}"),
    Claim("hookspread.started", HOOK_SPREAD[0], ("provenance/started",), "{}",
          compute=lambda iso: iso[:16].replace("T", " ") + " UTC"),
    Claim("hookspread.load", HOOK_SPREAD[0], ("provenance/load_before/0", (HOOK_SPREAD[-1], "provenance/load_after/0")),
          "{:.1f} before the first / {:.1f} after the last", compute=lambda *v: v),
    *(Claim(f"hookspread.range.{config}", HOOK_SPREAD[0], _run_ratios(HOOK_SPREAD, config), "{:.3f}-{:.3f}x",
            compute=lambda *ratios: (min(ratios), max(ratios)))
      for _, config in SPREAD_COLUMNS),
    *(Claim(f"hookspread.{name}", HOOK_SPREAD[0], (*_run_ratios(HOOK_SPREAD, upper), *_run_ratios(HOOK_SPREAD, lower)),
            "{:.1%}", compute=lambda *r: statistics.median(r[:len(HOOK_SPREAD)]) / statistics.median(r[len(HOOK_SPREAD):]) - 1)
      for name, upper, lower in (("python_over_builtin", "torch-allreduce-hook", "torch-builtin-hook"),
                                 ("none_over_python", "none", "torch-allreduce-hook"))),
)  # fmt: skip


def hook_run_claims(name: str, result: Result) -> tuple[Claim, ...]:
    """One run's stock step and every configuration's step over it, as ``hook.<name>.<config>``."""
    return (
        Claim(f"hook.{name}.stock", result, ("results/stock/median_step_ms",), "{:.1f} ms"),
        *(Claim(f"hook.{name}.{short}", result, (f"results/{config}/ratio_to_stock",), "{:.3f}x")
          for short, config in (("torch", "torch-allreduce-hook"), ("none", "none"), ("sidco", "sidco-exp@0.01"),
                                ("topk", "topk@0.01"))),
    )  # fmt: skip


HOOK_MEAN_PASS = Result(
    "results/hook_overhead/mean_pass.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/hook_overhead/mean_pass.py --json results/hook_overhead/mean_pass.json",
)
HOOK_CLAIMS = (
    Claim("hook.mean_pass.numel", HOOK_MEAN_PASS, ("args/numel",), "{:,}"),
    Claim("hook.mean_pass.allreduce", HOOK_MEAN_PASS, ("results/allreduce/median_ms",), "{:.2f} ms"),
    Claim("hook.mean_pass.extra", HOOK_MEAN_PASS,
          ("results/mean-then-allreduce/median_ms", "results/allreduce/median_ms"), "{:.2f} ms",
          compute=lambda both, plain: both - plain),
    Claim("hook.mean_pass.shard", HOOK_MEAN_PASS,
          ("results/reduce-scatter-mean-allgather/median_ms", "results/reduce-scatter-mean-allgather/ratio_to_allreduce"),
          "{:.2f} ms ({:.2f}x one all_reduce)", compute=lambda *v: v),
    *hook_run_claims("repeat", HOOK_REPEAT),
    Claim("hook.repeat.builtin", HOOK_REPEAT, ("results/torch-builtin-hook/ratio_to_stock",), "{:.3f}x"),
    *hook_run_claims("afternoon", HOOK_AFTERNOON[0]),
    *hook_run_claims("afternoon.repeat", HOOK_AFTERNOON[1]),
    Claim("hook.afternoon.commit", HOOK_AFTERNOON[0], ("provenance/commit",), "{:.7}"),
    *hook_run_claims("evening", HOOK_EVENING[0]),
    *hook_run_claims("evening.repeat", HOOK_EVENING[1]),
    *(Claim(f"hook.evening{suffix}.builtin", result, ("results/torch-builtin-hook/ratio_to_stock",), "{:.3f}x")
      for suffix, result in zip(("", ".repeat"), HOOK_EVENING, strict=True)),
    Claim("hook.evening.commit", HOOK_EVENING[0], ("provenance/commit",), "{:.7}"),
    Claim("hook.evening.load", HOOK_EVENING[1], ("provenance/load_before/0", "provenance/load_after/0"),
          "{:.1f} before / {:.1f} after", compute=lambda *v: v),
    Claim("hook.afternoon.load", HOOK_AFTERNOON[0], ("provenance/load_before/0", "provenance/load_after/0"),
          "{:.1f} before / {:.1f} after", compute=lambda *v: v),
    Claim("hook.commit", HOOK, ("provenance/commit",), "{:.7}"),
    Claim("hook.load", HOOK, ("provenance/load_before/0", "provenance/load_after/0"), "{:.1f} before / {:.1f} after",
          compute=lambda *v: v),
    Claim("hook.started", HOOK, ("provenance/started",), compute=lambda t: t[:16].replace("T", " ") + " UTC"),
    Claim("hook.wall", HOOK, ("provenance/wall_s",), "{:.0f} s"),
    Claim("hook.steps", HOOK, ("args/steps",)),
    # the pass that turns a hook's summed bucket into the mean (profile, rank 0, per step), and its share of
    # stock DDP's step: what any comm hook pays that stock DDP fuses into its copy into the bucket
    *(Claim(f"hook.{config}.mean_pass", HOOK, (f"results/{config}/profile/operators_self_ms/{op}/self_ms",
                                                 "results/stock/median_step_ms"),
            "{:.2f} ms ({:.1f} % of stock DDP's step)", compute=lambda ms, step: (ms, 100 * ms / step))
      for config, op in (("none", "aten::mul_"), ("torch-allreduce-hook", "aten::div_"))),
    *(Claim(f"hook.{c}.ratio.plain", HOOK, (f"results/{c}/ratio_to_stock",), "{:.3f}x" if c in HOOK_TARGETS else "{:.2f}x")
      for c in ("none", "sidco-exp@0.01", "topk@0.01", "auto")),
)  # fmt: skip

# -- the smaller model: quantizers beside SIDCo and VGC (MLP, 300 steps, 100 Mbit/s) -----------
QUANTIZER_LABELS = (("`none` (fp32 allreduce)", "none"), ("`bf16` allreduce", "bf16"), ("`qsgd` (5-bit codes)", "qsgd"),
                    ("`signsgd` (1 bit)", "signsgd"), ("`sidco-exp` (ratio 0.01)", "sidco-exp"), ("`vgc` (alpha 1)", "vgc"))  # fmt: skip


def quantizer_claim(name: str, key: str, fmt: str, claim_id: str | None = None, **options: Any) -> Claim:
    """``key`` of arm ``name`` in the quantizer comparison (a median or mean over its seeds)."""
    return Claim(claim_id or f"quant.{name}.{key}", QUANTIZERS, (f"arms/{name}/{key}",), fmt, **options)


def quantizer_interval(name: str, path: str, spec: str, claim_id: str, unit: str = "") -> Claim:
    """A paired comparison of arm ``name`` of the quantizer comparison at ``path``."""
    return interval_claim(claim_id, QUANTIZERS, f"arms/{name}/{path}", spec, unit)


QUANTIZER_TABLE = Table(
    "choosing-quantizers",
    ("method", "bytes/step vs fp32", "median step", "median communicate", "test accuracy (mean)",
     "time to 80% (median)"),
    ("---",) * 6,
    tuple(
        (
            label,
            quantizer_claim(name, "compression_factor", "{:.0f}x" if name == "none" else "1/{:.2g}"),
            quantizer_claim(name, "step_time_median_s", "{:.3f} s"),
            quantizer_claim(name, "communicate_median_s", "{:.3f} s"),
            quantizer_claim(name, "final_test_accuracy", "{:.3f}"),
            quantizer_claim(name, "time_to_accuracy_s", "{:.1f} s", missing="not reached"),
        )
        for label, name in QUANTIZER_LABELS
    ),
)  # fmt: skip
QUANTIZER_CLAIMS = (
    Claim("quant.commit", QUANTIZERS, ("provenance/commit",), "{:.7}"),
    load_claim("quant.load", QUANTIZERS),
    *(quantizer_claim(name, "final_test_accuracy", "{:.2f}", f"quant.{name}.accuracy")
      for name in ("none", "powersgd-r1", "powersgd-r8")),
    quantizer_claim("qsgd", "compression_factor", "{:.1f}x", "quant.qsgd.fewer"),
    quantizer_claim("sidco-exp", "compression_factor", "{:.0f}x", "quant.sidco.fewer"),
    *(quantizer_claim(name, "time_to_accuracy_s", "{:.1f} s", f"quant.{name}.tta.readme", missing="not reached")
      for name in ("none", "bf16", "sidco-exp", "signsgd", "qsgd", "vgc", "terngrad", "efsignsgd", "powersgd-r1",
                   "powersgd-r8")),
    *(quantizer_interval("sidco-exp", f"sooner_than/{base}", ".1f", f"quant.sidco.sooner_than_{base}", "x")
      for base in ("none", "bf16")),
    *(quantizer_interval(name, "accuracy_points_vs_none", "+.2f", f"quant.{name}.points")
      for name in ("powersgd-r1", "powersgd-r8", "topk-dense", "alone", "signsgd", "sidco-exp")),
)  # fmt: skip


BITPACK = Result(
    "results/quantizers/bitpack_speed.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/quantizers/bitpack_speed.py",
)
#: The benchmark's rows: per size, the widths 1, 2, 3, 5 and 8 bits.
BITPACK_SIZES = ("235000", "4000000")
BITPACK_WIDTHS = (1, 2, 3, 5, 8)
BITPACK_TABLE = Table(
    "bitpack-speed",
    ("codes", "bits", "bit expansion (720bd68)", "int64 words (3bf43bd)", "current: uint8 planes, packbits at 1 bit"),
    ("---:", "---:", "---:", "---:", "---:"),
    tuple(
        (
            f"{int(size):,}",
            str(bits),
            *(
                Claim(f"bitpack.{size}.{bits}.{packer}", BITPACK,
                      (f"round_trip/{i * len(BITPACK_WIDTHS) + j}/{packer}_ms",), "{:.2f} ms")
                for packer in ("expand", "word", "planes")
            ),
        )
        for i, size in enumerate(BITPACK_SIZES)
        for j, bits in enumerate(BITPACK_WIDTHS)
    ),
)  # fmt: skip


def _qsgd_codec_ms(size: str, packer: str, part: str) -> Claim:
    return Claim(
        f"bitpack.qsgd.{size}.{packer}.{part}", BITPACK, (f"qsgd/{size}/{packer}_{part}_ms",), "{:.1f} ms"
    )


BITPACK_QSGD_TABLE = Table(
    "bitpack-qsgd",
    ("elements", "QSGD compress, int64 words", "uint8 planes", "decode of 4 payloads, int64 words", "uint8 planes"),
    ("---:",) * 5,
    tuple(
        (f"{int(size):,}", *(_qsgd_codec_ms(size, p, part) for part in ("compress", "decompress_4_workers")
                             for p in ("word", "planes")))
        for size in BITPACK_SIZES
    ),
)  # fmt: skip
BITPACK_CLAIMS = (
    Claim("bitpack.commit", BITPACK, ("provenance/commit",), "{:.7}"),
    load_claim("bitpack.load", BITPACK),
)  # fmt: skip


# -- scaling: the exchanges at 2-16 workers, and the cost model's predictions ---------------------
def point(label: str, key: str, workers: str | None = None) -> str:
    chosen = f"[label={label},workers={workers}]" if workers else f"{{label={label}}}"
    return f"points/{chosen}/{key}"


RECEIVED = "targets/exchanges/{}/received/in_k_entries_per_worker"
GAP_300 = "accuracy_at_equal_steps/gap_to_allgather/{}/16/*/300"
SCALING_CLAIMS = (
    Claim("scaling.allgather.hook_over_model", SCALING, (point("allgather", "hook_over_model"),), compute=spanned(".3f")),
    Claim("scaling.balanced.hook_over_model", SCALING, (point("balanced", "hook_over_model"),), compute=spanned(".2f")),
    Claim("scaling.shared-mask.hook_over_model", SCALING, (point("shared-mask", "hook_over_model"),),
          compute=spanned(".2f")),
    Claim("scaling.balanced.received", SCALING, (RECEIVED.format("balanced"),), "{:.2f}"),
    Claim("scaling.shared-mask.received", SCALING, (RECEIVED.format("shared-mask"),), "{:.2f}"),
    Claim("scaling.allgather.received", SCALING,
          (point("allgather", "hook_bytes_received", "16"), "targets/exchanges/balanced/received/k",
           "targets/rules/workers"),
          "{:.1f}", compute=lambda received, k, p: received / (8 * k * (p - 1) / p)),
    *(Claim(f"scaling.{name}.{kind}300", SCALING, (GAP_300.format(name),), "{:.1f} ± {:.1f}",
            compute=lambda gaps, sign=sign: (sign * 100 * statistics.mean(gaps), 100 * statistics.stdev(gaps)))
      for name in ("balanced", "shared-mask") for kind, sign in (("gap", 1), ("trails", -1))),
    Claim("scaling.calibration.mbit", SCALING, ("calibration/bandwidth_mbit",), "{:.1f}"),
    Claim("scaling.calibration.latency", SCALING, ("calibration/latency_per_message_s",), "{:.2f}",
          compute=lambda s: 1e3 * s),
    *(Claim(f"scaling.{name}.nic16", SCALING, (point(name, "nic_over_model", "16"),), "{:.2f}x")
      for name in ("balanced", "shared-mask")),
    *(Claim(f"scaling.{name}.floor16", SCALING, (point(name, "localhost_step_s", "16"),), "{:.0f} ms",
            compute=lambda s: 1e3 * s)
      for name in ("allgather", "balanced", "shared-mask", "fp32")),
    Claim("scaling.nic_agreement", SCALING,
          (point("allgather", "nic_over_model"), point("fp32", "nic_over_model"),
           point("balanced", "nic_over_model", "2"), point("shared-mask", "nic_over_model", "2")),
          "{:.1f} %", compute=lambda *ratios: 100 * max(abs(r - 1) for r in (*ratios[0], *ratios[1], *ratios[2:]))),
    Claim("scaling.received_bound", SCALING, ("targets/exchanges/balanced/received/bound_bytes",), "{:.0f} kB",
          compute=lambda b: b / 1e3),
    Claim("scaling.fp32.link_share", SCALING, (point("fp32", "link_share"),), "{:.0f}-{:.0f} %",
          compute=lambda shares: (100 * min(shares), 100 * max(shares))),
    Claim("scaling.fp32.calibrated_error", SCALING, (point("fp32", "error_calibrated"),), "{:.1f} %",
          compute=lambda errors: 100 * max(map(abs, errors))),
    *(Claim(f"scaling.{name}.speedup16", SCALING, (f"targets/exchanges/{name}/step_speedup/speedup",), "{:.2f}x")
      for name in ("balanced", "shared-mask")),
    *(Claim(f"scaling.{name}.accuracy300", SCALING, (f"accuracy_at_equal_steps/accuracy/{name}/16/*/300",),
            "{:.3f} ± {:.3f}", compute=lambda accs: (statistics.mean(accs), statistics.stdev(accs)))
      for name in ("allgather", "balanced", "shared-mask")),
    *(Claim(f"scaling.{name}.gaps300", SCALING, (GAP_300.format(name),), "{}",
            compute=lambda gaps: ", ".join(f"{100 * g:+.2f}" for g in gaps))
      for name in ("balanced",)),
    *(Claim(f"scaling.{name}.gap_by_step", SCALING,
            tuple(f"accuracy_at_equal_steps/gap_to_allgather/{name}/16/*/{step}" for step in (100, 200, 300)),
            "{:.1f}, {:.1f}, {:.1f}", compute=lambda *by_step: tuple(100 * statistics.mean(g) for g in by_step))
      for name in ("balanced", "shared-mask")),
)  # fmt: skip
LARGEST = "predictions/100gbit/{}/seconds/-1"
PREDICTION_CLAIMS = (
    Claim("predict.ring_latency", PREDICTIONS, ("workers/-1", "scenario/latency_s"), "{:.0f} ms",
          compute=lambda p, latency: 2 * (p - 1) * latency * 1e3),
    Claim("predict.saving_1024", PREDICTIONS,
          (LARGEST.format("dense fp32 allreduce"), LARGEST.format("balanced (reduce-scatter + allgather)")),
          "{:.1f}x", compute=ratio),
    Claim("predict.dense_1024", PREDICTIONS, (LARGEST.format("dense fp32 allreduce"),), "{:.1f} ms",
          compute=lambda s: 1e3 * s),
    Claim("predict.balanced_1024", PREDICTIONS, (LARGEST.format("balanced (reduce-scatter + allgather)"),),
          "{:.1f} ms", compute=lambda s: 1e3 * s),
    Claim("predict.powersgd_100gbit", PREDICTIONS, ("crossover_vs_dense_fp32/100gbit/PowerSGD rank 10",), "{:,}"),
)  # fmt: skip


def escaped(key: str) -> str:
    """``key`` as one segment of a field path."""
    return key.replace("/", "\\/")


def slug(text: str) -> str:
    return re.sub(r"[^\w.]+", "-", text).strip("-")


CROSSOVER_ROWS = (
    ("dense bf16 allreduce", "dense bf16 allreduce"),
    ("`allgather`", "allgather"),
    ("`balanced` (sparse reduce-scatter + allgather, `2k(P-1)/P`)", "balanced (reduce-scatter + allgather)"),
    ("`balanced` at its `4k(P-1)/P` bound", "balanced, 4k(P-1)/P bound"),
    (
        "`balanced` at its measured traffic at 16 workers (benchmarks/scaling)",
        "balanced as measured (3.01 k(P-1)/P)",  # predict.py's row name carries the measured traffic
    ),
    ("`shared-mask`", "shared-mask"),
    ("PowerSGD rank 10 on 2048 x 2048 matrices (0.98 %)", "PowerSGD rank 10"),
)
CROSSOVER_TABLE = Table(
    "choosing-crossover",
    ("exchange", "1 Gbit/s", "10 Gbit/s", "100 Gbit/s"),
    ("---", "---:", "---:", "---:"),
    tuple(
        (label, *(Claim(f"predict.crossover.{slug(key)}.{link}", PREDICTIONS, (f"crossover_vs_dense_fp32/{link}/{escaped(key)}",),
                        "{:,}", missing="never") for link in ("1gbit", "10gbit", "100gbit")))
        for label, key in CROSSOVER_ROWS
    ),
)  # fmt: skip

HF_TRAINER = Result("results/integrations/hf_trainer.json", "python benchmarks/integrations/hf_trainer.py")
HF_TRAINER_ROWS = (
    ("gradsift (`topk` 0.01, the Trainer's AdamW in the hook)", "gradsift"),
    ("error feedback alone (`--plain-error-feedback`)", "plain"),
    ("the Trainer alone (`--without-gradsift`)", "alone"),
)
HF_TRAINER_TABLE = Table(
    "hf-trainer",
    ("run (300 steps, 2 workers)", "loss (mean ± sd, 3 seeds)", "vs the Trainer alone (mean ± sd)", "fewer bytes"),
    ("---", "---:", "---:", "---:"),
    tuple(
        (label,
         Claim(f"hf.{key}.loss", HF_TRAINER, (f"summary/{key}/loss_mean", f"summary/{key}/loss_sd"), "{:.3f} ± {:.3f}",
               compute=lambda m, s: (m, s)),
         Claim(f"hf.{key}.ratio", HF_TRAINER, (f"summary/{key}/ratio_mean", f"summary/{key}/ratio_sd"),
               "{:.2f}x ± {:.2f}", compute=lambda m, s: (m, s)),
         Claim(f"hf.{key}.bytes", HF_TRAINER, (f"summary/{key}/fewer_bytes",), "{:.1f}x"))
        for label, key in HF_TRAINER_ROWS
    ),
)  # fmt: skip

SIMULATED_40 = Result(
    "results/scaling/simulated/steps40.json",
    "python benchmarks/scaling/simulate_accuracy.py --workers 4 16 --seeds 0 1 2 --steps 40 --eval-every 0 "
    "--out results/scaling/simulated/steps40.json",
)


def _mean_sd_points(values: list[float]) -> tuple[float, float]:
    return 100 * statistics.fmean(values), 100 * statistics.stdev(values)


def _points_behind(values: list[float], reference: list[float]) -> float:
    return 100 * (statistics.fmean(values) - statistics.fmean(reference))


SIMULATED_TABLE = Table(
    "simulated-exchanges",
    ("workers", "exchange", "test accuracy after 40 steps (mean ± sd, 3 seeds)", "vs allgather", "received per step"),
    ("---:", "---", "---:", "---:", "---:"),
    tuple(
        (str(workers), f"`{exchange}`",
         Claim(f"sim40.{workers}.{exchange}.acc", SIMULATED_40, (f"runs/{{exchange={exchange},workers={workers}}}/final_accuracy",),
               "{:.1f}% ± {:.1f}", compute=_mean_sd_points),
         Claim(f"sim40.{workers}.{exchange}.vs", SIMULATED_40,
               (f"runs/{{exchange={exchange},workers={workers}}}/final_accuracy",
                f"runs/{{exchange=allgather,workers={workers}}}/final_accuracy"), "{:+.1f} pt", compute=_points_behind),
         Claim(f"sim40.{workers}.{exchange}.bytes", SIMULATED_40,
               (f"runs/{{exchange={exchange},workers={workers},seed=0}}/bytes_received_per_step",),
               "{:,.0f} B", compute=lambda values: values[0]))
        for workers in (4, 16) for exchange in ("allgather", "balanced", "shared-mask")
    ),
)  # fmt: skip

# -- step times over emulated 100 Mbit/s: VGG, 4 workers, 40 steps (issue 27's targets) ----------
STEPS40 = {
    name: Result(
        f"results/training/steps40/{name}.json",
        f"flock /tmp/gradsift-cpu.lock python benchmarks/provenance.py --json results/training/steps40/{name}.json "
        f"--seed 0 -- python -m gradsift train --model vgg --workers 4 --steps 40 --eval-every 0 --bandwidth 100mbit "
        f"--compressor {name}{' --ratio 0.01' if name in ('topk', 'sidco-exp') else ''} --seed 0 "
        f"--data-dir /usr/share/datasets/fashion-mnist --no-progress --json results/training/steps40/{name}.json",
    )
    for name in ("none", "bf16", "topk", "sidco-exp")
}


def _step_ms(name: str) -> Claim:
    return Claim(
        f"steps40.{name}.step", STEPS40[name], ("step_time_median_s",), "{:.0f} ms", compute=lambda s: 1e3 * s
    )


def _faster(name: str, than: str) -> Claim:
    return Claim(f"steps40.{name}.vs.{than}", STEPS40[name], ((STEPS40[than], "step_time_median_s"),
                 "step_time_median_s"), "{:.2f}x", compute=lambda other, own: other / own)  # fmt: skip


STEPS40_TABLE = Table(
    "steps40",
    ("method", "step (median)", "fp32 step / this step", "top-k step / this step", "compress ms (median)",
     "MB sent per step per worker"),
    ("---", "---:", "---:", "---:", "---:", "---:"),
    tuple(
        (label, _step_ms(name), _faster(name, "none"), _faster(name, "topk"),
         Claim(f"steps40.{name}.compress", STEPS40[name], ("compress_median_s",), "{:.1f}", compute=lambda s: 1e3 * s),
         Claim(f"steps40.{name}.mb", STEPS40[name], ("bytes_sent_per_step",), "{:.3f}", compute=lambda b: b / 1e6))
        for label, name in (("`none` (fp32)", "none"), ("`bf16`", "bf16"), ("`topk` 0.01", "topk"),
                            ("`sidco-exp` 0.01", "sidco-exp"))
    ),
)  # fmt: skip
DDP_CONFIGS = ("stock", "none", "bf16", "topk@0.01", "topk@0.001", "dgc@0.01", "dgc@0.001", "sidco-exp@0.01",
               "sidco-exp@0.001")  # fmt: skip


def _ddp_table(world: str) -> Table:
    def cell(config: str, key: str, fmt: str) -> Cell:
        if config == "stock" and key != "median_step_ms":
            return "-"
        return Claim(f"ddptab.{world}.{config}.{key}", DDP, (f"results/{world}/{config}/{key}",), fmt)

    return Table(
        f"ddp-{world}-ranks",
        ("configuration", "median step", "vs stock DDP", "bytes sent / step", "density",
         "compress / communicate / decompress ms"),
        ("---", "---:", "---:", "---:", "---:", "---"),
        tuple(
            (config, cell(config, "median_step_ms", "{:.1f} ms"),
             Claim(f"ddptab.{world}.{config}.ratio", DDP, (f"results/{world}/{config}/ratio_to_stock",), "{:.2f}x"),
             cell(config, "bytes_sent", "{:.0f}"), cell(config, "density", "{:.4f}"),
             "-" if config == "stock" else Claim(
                 f"ddptab.{world}.{config}.phases", DDP,
                 tuple(f"results/{world}/{config}/{k}_ms" for k in ("compress", "communicate", "decompress")),
                 "{:.1f} / {:.1f} / {:.1f}", compute=lambda *v: v))
            for config in DDP_CONFIGS
        ),
    )  # fmt: skip


POWERSGD_RANK_LABELS = {"powersgd-r1": "`powersgd` rank 1 (PyTorch's default)", "powersgd-r2": "`powersgd` rank 2",
                        "powersgd-r4": "`powersgd` rank 4", "powersgd-r8": "`powersgd` rank 8 (the default)"}  # fmt: skip
QUANTIZER_RUNS = ("none", "bf16", "qsgd", "terngrad", "signsgd", "efsignsgd", *POWERSGD_RANK_LABELS, "sidco-exp",
                  "vgc", "topk-dense", "alone")  # fmt: skip
#: Arms whose phases the trainer cannot split: PyTorch's hook communicates between its products.
QUANTIZER_UNSPLIT = dict.fromkeys(POWERSGD_RANK_LABELS, "not split (inside PyTorch's hook)")
#: The controls' rows: their label and link (they run without the emulated link).
QUANTIZER_CONTROLS = {"topk-dense": ("`topk` at ratio 1: the recipe run dense", "localhost"),
                      "alone": ("one worker alone: no communication", "none")}  # fmt: skip


def _quantizer_cells(name: str) -> tuple[Cell, ...]:
    """One arm's row of the quantizer comparison's table."""
    label, link = QUANTIZER_CONTROLS.get(name, (POWERSGD_RANK_LABELS.get(name, f"`{name}`"), "100 Mbit/s"))
    compared = name not in QUANTIZER_CONTROLS
    return (
        label,
        link,
        Claim(f"quantrun.{name}.bytes", QUANTIZERS,
              tuple(f"arms/{name}/bytes_{way}_per_step" for way in ("sent", "received")), "{:.0f} / {:.0f}",
              compute=lambda *v: v),
        quantizer_claim(name, "compression_factor", "{:.1f}x", f"quantrun.{name}.factor") if name != "alone" else "-",
        quantizer_claim(name, "step_time_median_s", "{:.1f} ms", f"quantrun.{name}.step", compute=lambda v: 1e3 * v),
        Claim(f"quantrun.{name}.phases", QUANTIZERS,
              tuple(f"arms/{name}/{k}_median_s" for k in ("compress", "communicate", "decompress")),
              "{:.1f} / {:.1f} / {:.1f}", compute=lambda *v: tuple(1e3 * x for x in v))
        if name not in QUANTIZER_UNSPLIT else QUANTIZER_UNSPLIT[name],
        quantizer_claim(name, "final_test_accuracy", "{:.4f}", f"quantrun.{name}.accuracy"),
        quantizer_interval(name, "accuracy_points_vs_none", "+.2f", f"quantrun.{name}.points")
        if name != "none" else "-",
        (quantizer_claim(name, "time_to_accuracy_s", "{:.1f} s", f"quantrun.{name}.tta", missing="not reached"),
         " (", quantizer_claim(name, "seeds_reaching_target", "{}", f"quantrun.{name}.reached"), "/3)"),
        quantizer_interval(name, "sooner_than/none", ".1f", f"quantrun.{name}.sooner", "x")
        if compared and name != "none" else "-",
    )  # fmt: skip


POWERSGD_RANK = Result(
    "results/quantizers/powersgd_rank.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/quantizers/powersgd_rank.py --json results/quantizers/powersgd_rank.json",
)
#: The rank study's rows: workload, arm, label (the baselines' and controls' rows as in the other tables).
POWERSGD_RANK_ROWS = tuple(
    (workload, arm, label)
    for workload in ("mlp", "vgg", "gpt-adamw")
    for arm, label in (
        ("none", "fp32"), ("bf16", "bf16"), ("alone", "one worker alone"),
        *((f"powersgd-r{r}", f"rank {r}" + (", frozen-variance AdamW in the hook (the one line before 177799b)"
                                             if workload == "gpt-adamw" else ""))
          for r in ((1, 2, 4) if workload == "gpt-adamw" else (1, 2, 4, 8))),
        *(((f"powersgd-r{r}-no-recipe", f"rank {r}, AdamW keeps its moments (the one line now)")
           for r in (1, 2, 4, 8)) if workload == "gpt-adamw" else ()),
        *((("topk-dense", "control: `topk` at ratio 1 under the same frozen-variance AdamW"),)
          if workload == "gpt-adamw" else ()),
    )
)  # fmt: skip
POWERSGD_RANK_WORKLOADS = {"mlp": "MLP, SGD, 4 workers, 300 steps", "vgg": "VGG, SGD, 4 workers, 200 steps",
                           "gpt-adamw": "GPT, AdamW, 2 workers, 314 steps"}  # fmt: skip


def _powersgd_rank_cells(workload: str, arm: str, label: str) -> tuple[Cell, ...]:
    """One row of the rank study: the metric's mean, its paired gap to fp32, bytes, seeds beating alone."""
    base = f"workloads/{workload}/arms/{arm}"
    unit = " %" if workload == "gpt-adamw" else " pts"
    cid = f"psgdrank.{workload}.{arm}"
    return (
        POWERSGD_RANK_WORKLOADS[workload],
        label,
        Claim(f"{cid}.mean", POWERSGD_RANK, (f"{base}/mean",), "{:.4f}"),
        interval_claim(f"{cid}.gap", POWERSGD_RANK, f"{base}/vs_none", "+.2f", unit) if arm != "none" else "-",
        Claim(f"{cid}.bytes", POWERSGD_RANK, (f"{base}/bytes_sent_per_step", f"{base}/bytes_received_per_step"),
              "{:,.0f} / {:,.0f}", compute=lambda *v: v),
        Claim(f"{cid}.alone", POWERSGD_RANK, (f"{base}/seeds_beating_alone",), "{}/3") if arm != "alone" else "-",
    )  # fmt: skip


POWERSGD_RANK_TABLE = Table(
    "powersgd-rank",
    ("workload", "run", "final test accuracy, or validation loss for the GPT (mean)",
     "vs fp32 (paired, 95 % CI; points, or % of the loss)", "bytes sent / received per step and worker",
     "seeds above the worker alone"),
    ("---", "---", "---:", "---:", "---:", "---:"),
    tuple(_powersgd_rank_cells(*row) for row in POWERSGD_RANK_ROWS),
)  # fmt: skip
POWERSGD_RANK_CLAIMS = (
    Claim("psgdrank.commit", POWERSGD_RANK, ("provenance/commit",), "{:.7}"),
    load_claim("psgdrank.load", POWERSGD_RANK),
    *(interval_claim(f"psgdrank.gpt.{arm}", POWERSGD_RANK, f"workloads/gpt-adamw/arms/{arm}/vs_none", "+.1f", " %")
      for arm in ("powersgd-r4-no-masking", "powersgd-r4")),
)  # fmt: skip


QUANTIZER_RUNS_TABLE = Table(
    "quantizer-runs",
    ("arm", "link", "bytes sent / received per step and worker", "sent vs fp32", "step (median)",
     "compress / comm / decompress (ms)", "test acc. @300 (mean)", "vs none (points, 95 % CI)",
     "time to 0.8 (median; seeds reaching it)", "sooner than none (paired, 95 % CI)"),
    ("---", "---", "---:", "---:", "---:", "---", "---:", "---:", "---:", "---:"),
    tuple(_quantizer_cells(name) for name in QUANTIZER_RUNS),
)  # fmt: skip
DEMO = Result(
    "results/hook_overhead/demo.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/provenance.py --json results/hook_overhead/demo.json -- "
    "gradsift demo --no-progress --out /tmp/sel-demo --json results/hook_overhead/demo.json (as root)",
)


def _demo(compressor: str, key: str, fmt: str) -> Claim:
    return Claim(f"demo.{compressor}.{key}", DEMO, (f"rows/[compressor={compressor}]/{key}",), fmt)


DEMO_TABLE = Table(
    "demo",
    ("run", "MB per step", "fewer bytes than fp32", "compression overhead", "step", "test accuracy",
     "time to 0.80"),
    ("---", "---:", "---:", "---:", "---:", "---:", "---:"),
    tuple(
        (f"`{name}`", Claim(f"demo.{name}.mb", DEMO, (f"rows/[compressor={name}]/bytes_per_step",), "{:.3f}",
                            compute=lambda b: b / 1e6),
         _demo(name, "compression_factor", "{:.1f}x"), _demo(name, "overhead_ms", "{:.1f} ms"),
         _demo(name, "step_ms", "{:.1f} ms"), _demo(name, "accuracy", "{:.3f}"),
         Claim(f"demo.{name}.tta", DEMO, (f"rows/[compressor={name}]/time_to_accuracy_s",), "{:.1f} s",
               missing="not reached"))
        for name in ("none", "bf16", "sidco-exp", "topk", "vgc")
    ),
)  # fmt: skip
DEMO_CLAIMS = (
    Claim("demo.commit", DEMO, ("provenance/commit",), "{:.7}"),
    load_claim("demo.load", DEMO, "{:.1f} before / {:.1f} after"),
)  # fmt: skip
CONVERGENCE = Result(
    "results/convergence/results.json", "python benchmarks/convergence/analyze.py --update-docs"
)


def _adamw(method: str, workload: str = "gpt-adamw", name: str = "adamw") -> Claim:
    """``workload``'s final validation loss of ``method``: mean ± sd over its seeds."""
    path = f"workloads/{workload}/methods/{method}"
    return Claim(f"verdict.{name}.{method}", CONVERGENCE, (f"{path}/final_mean", f"{path}/final_sd", f"{path}/seeds"),
                 "{:.3f} ± {:.3f} ({} seeds)", compute=lambda mean, sd, seeds: (mean, sd, len(seeds)))  # fmt: skip


def _adamw_fewer(method: str, workload: str, name: str) -> Claim:
    """How many times fewer bytes than fp32 ``method`` sent on ``workload``."""
    return Claim(f"verdict.{name}.{method}.fewer", CONVERGENCE,
                 (f"workloads/{workload}/methods/{method}/fewer_bytes_than_fp32",), "{:.1f}x")  # fmt: skip


VERDICT_CLAIMS = (
    _adamw("none"),
    _adamw("alone"),
    _adamw("topk-0.01"),
    _adamw("diloco-avg-h10"),
    _adamw("qavg-blockquant4-h10"),
    Claim("verdict.adamw.qavg.fewer", CONVERGENCE,
          ("workloads/gpt-adamw/methods/qavg-blockquant4-h10/fewer_bytes_than_fp32",), "{:.1f}x"),
    Claim("verdict.adamw.topk.fewer", CONVERGENCE, ("workloads/gpt-adamw/methods/topk-0.01/fewer_bytes_than_fp32",),
          "{:.1f}x"),
    Claim("verdict.adamw.avg.fewer", CONVERGENCE,
          ("workloads/gpt-adamw/methods/diloco-avg-h10/fewer_bytes_than_fp32",), "{:.1f}x"),
    *(_adamw(m, "gpt-adamw-3k", "adamw3k") for m in ("none", "qavg-blockquant4-h10", "onebit-adam")),
    *(_adamw_fewer(m, "gpt-adamw-3k", "adamw3k") for m in ("qavg-blockquant4-h10", "onebit-adam")),
    *(Claim(f"verdict.adamw3k.onebit-adam.sooner{'' if link == '100mbit' else '.' + link}.{baseline}", CONVERGENCE,
            (f"workloads/gpt-adamw-3k/methods/onebit-adam/sooner_than_{baseline}_{link}",), "{:.1f}x")
      for link in ("100mbit", "1gbit") for baseline in ("none", "bf16")),
    *(_adamw(m, "gpt-adamw-w4-3k", "adamw-w4-3k") for m in ("none", "alone", "qavg-blockquant4-h10", "onebit-adam")),
    *(Claim(f"verdict.adamw-w4-3k.onebit-adam.sooner.{baseline}", CONVERGENCE,
            (f"workloads/gpt-adamw-w4-3k/methods/onebit-adam/sooner_than_{baseline}_100mbit",), "{:.1f}x")
      for baseline in ("none", "bf16")),
)  # fmt: skip
STEPS40_CLAIMS = (
    Claim("steps40.commit", STEPS40["sidco-exp"], ("provenance/commit",), "{:.7}"),
    Claim("steps40.load", STEPS40["none"], ("provenance/load_before/0", (STEPS40["sidco-exp"], "provenance/load_after/0")),
          "{:.1f} before the first run / {:.1f} after the last", compute=lambda *v: v),
    # top-k's step over SIDCo's with SIDCo's selection taken out: the most a cheaper selection can give
    Claim("steps40.sidco.ceiling", STEPS40["topk"], ("step_time_median_s", (STEPS40["sidco-exp"], "step_time_median_s"),
          (STEPS40["sidco-exp"], "compress_median_s")), "{:.2f}x", compute=lambda topk, sidco, compress: topk / (sidco - compress)),
)  # fmt: skip


# -- SIDCo against top-k at every size, alone and contended (benchmarks/compress/README.md) ----------
def _compress_result(name: str, command: str) -> Result:
    return Result(f"results/compress/{name}.json", f"flock /tmp/gradsift-cpu.lock {command}")


_SWEEP = "gradsift bench compress --ratios 0.01 --compressors topk dgc threshold sidco-exp sidco-gpareto sidco-gamma --threads 2"
COMPRESS_SMALL = _compress_result("sizes-small", f"{_SWEEP} --sizes 4096 ... 1048576 --repeats 41 --warmup 3")
COMPRESS_LARGE = _compress_result(
    "sizes-large", f"{_SWEEP} --sizes 2097152 ... 134217728 --repeats 5 --warmup 1"
)
_AT_25M = "gradsift bench compress --sizes 25000000 --ratios 0.01 --compressors topk dgc sidco-exp sidco-gpareto sidco-gamma"
COMPRESS_ALONE = _compress_result("alone-25M", f"{_AT_25M} --threads 2 --repeats 9 --warmup 2")
COMPRESS_CONTENDED = _compress_result(
    "contended-25M", f"{_AT_25M} --threads 2 --processes 4 --repeats 9 --warmup 2"
)
COMPRESS_CROSSOVER = _compress_result(
    "crossover-cpu", "python benchmarks/compress/crossover.py --clock cpu --threads 1"
)
SWEEP_SIZES = (
    (COMPRESS_SMALL, (4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576)),
    (COMPRESS_LARGE, (2097152, 4194304, 8388608, 16777216, 25000000, 33554432, 67108864, 134217728)),
)
SWEEP_VARIANTS = ("sidco-exp", "sidco-gpareto", "sidco-gamma", "dgc")


def _sweep_cell(result: Result, n: int, compressor: str, key: str, fmt: str) -> Claim:
    return Claim(
        f"sweep.{n}.{compressor}.{key}", result, (f"rows/[compressor={compressor},numel={n}]/{key}",), fmt
    )


COMPRESS_SWEEP_TABLE = Table(
    "compress-sweep",
    ("elements", "topk ms", "sidco-exp ms", *(f"topk / {v}" for v in SWEEP_VARIANTS)),
    ("---:",) * (3 + len(SWEEP_VARIANTS)),
    tuple(
        (f"{n:,}", _sweep_cell(result, n, "topk", "compress_ms", "{:.3f}"),
         _sweep_cell(result, n, "sidco-exp", "compress_ms", "{:.3f}"),
         *(_sweep_cell(result, n, v, "speedup_vs_topk_compressor", "{:.2f}") for v in SWEEP_VARIANTS))
        for result, sizes in SWEEP_SIZES for n in sizes
    ),
)  # fmt: skip
_AT_25M_ROWS = "rows/[compressor={},numel=25000000]/compress_ms"
COMPRESS_25M_TABLE = Table(
    "compress-25m",
    ("compressor", "alone ms", "4 x 2 contended ms", "contended / alone", "contended time / topk's contended"),
    ("---", "---:", "---:", "---:", "---:"),
    tuple(
        (c, Claim(f"at25m.{c}.alone", COMPRESS_ALONE, (_AT_25M_ROWS.format(c),), "{:.1f}"),
         Claim(f"at25m.{c}.contended", COMPRESS_CONTENDED, (_AT_25M_ROWS.format(c),), "{:.1f}"),
         Claim(f"at25m.{c}.slowdown", COMPRESS_CONTENDED, (_AT_25M_ROWS.format(c), (COMPRESS_ALONE, _AT_25M_ROWS.format(c))),
               "{:.1f}x", compute=ratio),
         Claim(f"at25m.{c}.vs_topk", COMPRESS_CONTENDED, (_AT_25M_ROWS.format(c), _AT_25M_ROWS.format("topk")), "{:.3f}",
               compute=ratio))
        for c in ("topk", "dgc", "sidco-exp", "sidco-gpareto", "sidco-gamma")
    ),
)  # fmt: skip
#: The registry's ratio compressors at 25M elements, three ratios (``results.json``).
REGISTRY_RATIOS = ("0.1", "0.01", "0.001")
REGISTRY_SPARSIFIERS = (
    "topk",
    "randomk",
    "dgc",
    "redsync",
    "gaussiank",
    "threshold",
    "sidco-exp",
    "sidco-gpareto",
    "sidco-gamma",
)
REGISTRY_CODES = ("none", "fp16", "bf16", "qsgd", "terngrad", "signsgd", "efsignsgd")


def _registry_row(name: str, ratio: str) -> str:
    return f"rows/[compressor={name},ratio={ratio}]"


def _at_each_ratio(claim_id: str, name: str, key: str) -> Claim:
    return Claim(
        claim_id,
        COMPRESS,
        tuple(f"{_registry_row(name, r)}/{key}" for r in REGISTRY_RATIOS),
        "{:.2f} / {:.2f} / {:.2f}",
        compute=lambda *v: v,
    )


COMPRESS_REGISTRY_TABLE = Table(
    "compress-registry",
    (
        "compressor",
        *(f"ratio {r}" for r in REGISTRY_RATIOS),
        "count/k at 0.1 / 0.01 / 0.001",
        "`topk`'s time over its own at 0.1 / 0.01 / 0.001",
    ),
    ("---", "---:", "---:", "---:", "---", "---"),
    (
        (
            "bare `torch.topk`",
            *(
                Claim(f"registry.bare-topk.{r}", COMPRESS, (f"{_registry_row('topk', r)}/topk_ms",), "{:.0f}")
                for r in REGISTRY_RATIOS
            ),
            "-",
            "-",
        ),
        (
            "floor (one read pass)",
            *(
                Claim(f"registry.floor.{r}", COMPRESS, (f"{_registry_row('topk', r)}/floor_ms",), "{:.1f}")
                for r in REGISTRY_RATIOS
            ),
            "-",
            "-",
        ),
        *(
            (
                name,
                *(
                    Claim(
                        f"registry.{name}.{r}",
                        COMPRESS,
                        tuple(
                            f"{_registry_row(name, r)}/{k}"
                            for k in ("compress_ms", "speedup_vs_topk", "compress_vs_floor")
                        ),
                        "{:.1f} ({:.2f}x, {:.1f} floors)",
                        compute=lambda *v: v,
                    )
                    for r in REGISTRY_RATIOS
                ),
                _at_each_ratio(f"registry.{name}.count", name, "count_vs_target"),
                _at_each_ratio(f"registry.{name}.vs_topk_compressor", name, "speedup_vs_topk_compressor"),
            )
            for name in REGISTRY_SPARSIFIERS
        ),
    ),
)
COMPRESS_CODES_TABLE = Table(
    "compress-codes",
    ("compressor", "compress ms", "decompress ms", "bits per element"),
    ("---", "---:", "---:", "---:"),
    tuple(
        (
            name,
            Claim(
                f"registry.{name}.compress", COMPRESS, (f"rows/[compressor={name}]/compress_ms",), "{:.0f}"
            ),
            Claim(
                f"registry.{name}.decompress",
                COMPRESS,
                (f"rows/[compressor={name}]/decompress_ms",),
                "{:.0f}",
            ),
            Claim(
                f"registry.{name}.bits",
                COMPRESS,
                (f"rows/[compressor={name}]/nbytes", f"rows/[compressor={name}]/numel"),
                "{:.2f}",
                compute=lambda nbytes, numel: 8 * nbytes / numel,
            ),
        )
        for name in REGISTRY_CODES
    ),
)
RANDOMK_SAMPLING = Result(
    "results/compress/randomk_sampling.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/compress/randomk_sampling.py "
    "--json results/compress/randomk_sampling.json",
)
#: The sampler script's rows: per ratio, the cut permutation, then random-k's own sampler.
RANDOMK_SAMPLING_RATIOS = ("0.1", "0.01", "0.001")
RANDOMK_SAMPLING_TABLE = Table(
    "randomk-sampling",
    (
        "ratio",
        "`randperm(n)[:k]` (a generator)",
        "first k distinct of a uniform stream (random-k's: hashed draws)",
    ),
    ("---", "---:", "---:"),
    tuple(
        (
            ratio,
            *(
                Claim(
                    f"rksample.{ratio}.{j}", RANDOMK_SAMPLING, (f"rows/{2 * i + j}/median_ms",), "{:.1f} ms"
                )
                for j in (0, 1)
            ),
        )
        for i, ratio in enumerate(RANDOMK_SAMPLING_RATIOS)
    ),
)
COMPRESS_SWEEP_CLAIMS = (
    Claim("sweep.sizes-small.commit", COMPRESS_SMALL, ("provenance/commit",), "{:.7}"),
    Claim("sweep.crossover-cpu.commit", COMPRESS_CROSSOVER, ("provenance/commit",), "{:.7}"),
    Claim("rksample.commit", RANDOMK_SAMPLING, ("provenance/commit",), "{:.7}"),
    Claim("sweep.sizes-large.wall_s", COMPRESS_LARGE, ("provenance/wall_s",), "{:.0f} s"),
    *(Claim(f"sweep.{r.path.rsplit('/', 1)[-1][:-5]}.load", r, ("provenance/load_before/0", "provenance/load_after/0"),
            "{:.1f} / {:.1f}", compute=lambda *v: v)
      for r in (COMPRESS_SMALL, COMPRESS_LARGE, COMPRESS_ALONE, COMPRESS_CONTENDED, COMPRESS_CROSSOVER)),
    *(Claim(f"sweep.crossover.{v}", COMPRESS_CROSSOVER, (f"crossover/{v}",), "{:,}")
      for v in ("sidco-exp", "sidco-gpareto", "sidco-gamma")),
)  # fmt: skip


# -- TernGrad's error on real gradients against the paper's clipped recipe (quantizers/README.md) --
TERNGRAD = Result(
    "results/quantizers/terngrad_variance.json",
    "nice -n 19 python benchmarks/quantizers/terngrad_variance.py --out results/quantizers/terngrad_variance.json",
)
TERNGRAD_MODELS = ("vgg", "lstm", "gpt")


def _times_reference(mses: list[float], references: list[float]) -> str:
    """``"lo-hi"x`` over the snapshots of a configuration's error over the reference's."""
    ratios = [mse / reference for mse, reference in zip(mses, references, strict=True)]
    low, high = (f"{r:.2f}" if r < 10 else f"{r:.0f}" for r in (min(ratios), max(ratios)))
    return f"{low}x" if low == high else f"{low}-{high}x"


def _terngrad_cell(model: str, configuration: str) -> Claim:
    snapshots = f"models/{model}/snapshots/*"
    return Claim(f"terngrad.{model}.{slug(configuration)}", TERNGRAD,
                 (f"{snapshots}/{configuration}", f"{snapshots}/reference_mse"), compute=_times_reference)  # fmt: skip


TERNGRAD_TABLE = Table(
    "terngrad-variance",
    ("gradsift `terngrad`", *TERNGRAD_MODELS),
    ("---", *("---:" for _ in TERNGRAD_MODELS)),
    tuple(
        (label, *(_terngrad_cell(model, configuration) for model in TERNGRAD_MODELS))
        for label, configuration in (
            ("before clipping, one scale per bucket (the hook's default granularity)", "bucket, no clip"),
            ('before clipping, `granularity="layer"`', "layer, no clip"),
            ("`clip=2.5` (the default), one scale per bucket", "bucket, clip 2.5"),
            ('`clip=2.5`, `granularity="layer"` (the paper\'s per-layer scale)', "layer, clip 2.5"),
        )
    ),
)


# -- clean exit: abnormal exits of a plain user script (scripts/exit_stress.py) ------------------
EXIT = Result(
    "results/exit/results.json",
    "nice -n 19 python scripts/exit_stress.py --runs 200 --steps 20 --compressors sidco-exp fp16 vgc powersgd "
    "--jobs 2 --json results/exit/results.json",
)
EXIT_COMPRESSORS = ("sidco-exp", "fp16", "vgc", "powersgd")
EXIT_TABLE = Table(
    "exit-stress",
    ("compressor", "runs", "abnormal", "hung"),
    ("---", "---:", "---:", "---:"),
    tuple(
        (f"`{name}`", *(Claim(f"exit.{name}.{field}", EXIT, (f"results/{name}/{field}",))
                        for field in ("runs", "abnormal", "timed_out")))
        for name in EXIT_COMPRESSORS
    ),
)  # fmt: skip
EXIT_CLAIMS = (
    Claim("exit.commit", EXIT, ("sessions/0/provenance/commit",), "{:.7}"),
    Claim("exit.started", EXIT, ("sessions/0/provenance/started",), compute=lambda t: t[:16].replace("T", " ") + " UTC"),
    Claim("exit.load", EXIT, ("sessions/0/provenance/load_before/0", "sessions/1/provenance/load_after/0"),
          "{:.1f} before / {:.1f} after", compute=lambda *v: v),
    Claim("exit.abnormal.total", EXIT, tuple(f"results/{name}/abnormal" for name in EXIT_COMPRESSORS),
          compute=lambda *v: sum(v)),
)  # fmt: skip


# -- the one line, compressor="auto" (benchmarks/auto/one_line.py) -------------------------------------
_ONE_LINE = "flock /tmp/gradsift-cpu.lock python benchmarks/auto/one_line.py"
#: (link, what auto could pick, result, arms): localhost and 100 Mbit/s at 589aa13, when the
#: 1-bit Adam method was a candidate in every run; 100 Mbit/s again once it is one only in long runs.
AUTO_LINKS = (
    (
        "localhost",
        "with 1-bit Adam",
        Result("results/auto/localhost.json", f"{_ONE_LINE} --json results/auto/localhost.json"),
        ("none", "bf16", "auto", "alone"),
    ),
    (
        "100 Mbit/s",
        "with 1-bit Adam",
        Result(
            "results/auto/100mbit-onebit.json",
            f"{_ONE_LINE} --bandwidth 100mbit --arms none bf16 auto --json results/auto/100mbit.json",
        ),
        ("none", "bf16", "auto"),
    ),
    (
        "100 Mbit/s",
        "1-bit Adam in long runs only",
        Result(
            "results/auto/100mbit.json",
            f"{_ONE_LINE} --bandwidth 100mbit --arms none auto --json results/auto/100mbit.json",
        ),
        ("none", "auto"),
    ),
)
AUTO_ARMS = {
    "none": "stock DDP (`none`)",
    "bf16": "`bf16`",
    "auto": "`auto` (the one line)",
    "alone": "one worker alone (no communication)",
}


def _auto_ratio(result: Result, arm: str, field: str) -> Claim | str:
    """``arm``'s paired ratio to stock DDP and its 95 % interval; the baseline's own row says 1."""
    if arm == "none":
        return "1"
    return Claim(
        f"auto.{result.path}.{arm}.{field}",
        result,
        (f"ratios_to_none/{arm}/{field}",),
        "{:.3f}x [{:.3f}, {:.3f}]",
        compute=tuple,
    )


def _auto_bytes(result: Result, arm: str) -> Claim:
    """``arm``'s bytes sent and received per step per worker, means over its seeds (MB)."""
    fields = (f"runs/{{arm={arm}}}/bytes_sent_per_step", f"runs/{{arm={arm}}}/bytes_received_per_step")
    return Claim(
        f"auto.{Path(result.path).stem}.{arm}.bytes",
        result,
        fields,
        "{:.3f} / {:.3f}",
        compute=lambda sent, received: (statistics.mean(sent) / 1e6, statistics.mean(received) / 1e6),
    )


def _auto_choices(result: Result, arm: str) -> Claim | str:
    if arm != "auto":
        return "-"
    return Claim(
        f"auto.{result.path}.choices",
        result,
        ("runs/{arm=auto}/auto/choice",),
        "{}",
        compute=lambda choices: ", ".join(sorted(set(choices))),
    )


AUTO_TABLE = Table(
    "auto-one-line",
    ("link", "auto's Adam candidates", "arm", "chose", "validation loss / stock", "median step / stock",
     "wall time / stock", "MB sent / received per step per worker"),
    ("---", "---", "---", "---", "---:", "---:", "---:", "---:"),
    tuple(
        (link, candidates, AUTO_ARMS[arm], _auto_choices(result, arm),
         *(_auto_ratio(result, arm, field) for field in ("final_validation_loss", "step_time_median_s", "wall_time_s")),
         _auto_bytes(result, arm))
        for link, candidates, result, arms in AUTO_LINKS
        for arm in arms
    ),
)  # fmt: skip
AUTO_CLAIMS = tuple(
    Claim(f"auto.{Path(result.path).stem}.{key}", result, (path,), fmt, compute=compute)
    for _, _, result, _ in AUTO_LINKS
    for key, path, fmt, compute in (
        ("commit", "provenance/commit", "{:.7}", None),
        ("load", "provenance/load_before/0", "{:.1f}", None),
        ("seeds", "provenance/seeds", "{}", lambda seeds: len(seeds)),
    )
)


# -- a third-party GPT script with the line a user adds (benchmarks/thirdparty/nanogpt.py) -----------
_NANOGPT = "flock /tmp/gradsift-cpu.lock python benchmarks/thirdparty/nanogpt.py"
#: (link, result, arms after stock DDP's row).
NANOGPT_LINKS = (
    ("localhost", Result("results/thirdparty/nanogpt-localhost.json",
                         f"{_NANOGPT} --arms stock one-line bf16 alone zero-one "
                         "--json results/thirdparty/nanogpt-localhost.json"),
     ("one-line", "bf16", "zero-one", "alone")),
    ("100 Mbit/s", Result("results/thirdparty/nanogpt-100mbit.json",
                          f"{_NANOGPT} --bandwidth 100mbit --arms stock one-line "
                          "--json results/thirdparty/nanogpt-100mbit.json"),
     ("one-line",)),
)  # fmt: skip
NANOGPT_ARMS = {
    "one-line": "`register_comm_hook(model)` (the one line)",
    "bf16": "`register_comm_hook(model, 'bf16')`",
    "zero-one": "0/1 Adam's local steps (`adam='zero-one'`, 100 warm-up steps in 4-bit codes, `local_steps=(100, 2)`)",
    "alone": "one worker alone (no communication)",
}


def _nanogpt(result: Result, arm: str, field: str, fmt: str) -> Claim:
    return Claim(f"nanogpt.{Path(result.path).stem}.{arm}.{field}", result, (f"summary/{arm}/{field}",), fmt,
                 compute=lambda v: (v["mean"], v["low"], v["high"]))  # fmt: skip


def _nanogpt_row(link: str, result: Result, arm: str) -> tuple[Cell, ...]:
    chose = Claim(f"nanogpt.{Path(result.path).stem}.{arm}.choices", result, (f"summary/{arm}/choices",),
                  compute=lambda c: ", ".join(c) or "-")  # fmt: skip
    fewer = Claim(f"nanogpt.{Path(result.path).stem}.{arm}.fewer", result, (f"summary/{arm}/fewer_bytes_received",),
                  "{:.1f}x", missing="no communication")  # fmt: skip
    return (link, NANOGPT_ARMS[arm], chose, _nanogpt(result, arm, "loss_gap_percent", "{:+.2f} % [{:+.2f}, {:+.2f}]"),
            _nanogpt(result, arm, "step_time_median_s", "{:.3f}x [{:.3f}, {:.3f}]"),
            _nanogpt(result, arm, "wall_time_s", "{:.3f}x [{:.3f}, {:.3f}]"), fewer)  # fmt: skip


NANOGPT_TABLE = Table(
    "thirdparty-nanogpt",
    ("link", "line added after the script's `DDP(model)`", "auto chose", "validation loss vs stock DDP",
     "median iteration / stock", "wall time / stock", "fewer bytes received than stock"),
    ("---", "---", "---", "---:", "---:", "---:", "---:"),
    tuple(_nanogpt_row(link, result, arm) for link, result, arms in NANOGPT_LINKS for arm in arms),
)  # fmt: skip
NANOGPT_CLAIMS = tuple(
    Claim(f"nanogpt.{Path(result.path).stem}.{key}", result, (path,), fmt, compute=compute)
    for _, result, _ in NANOGPT_LINKS
    for key, path, fmt, compute in (
        ("commit", "provenance/commit", "{:.7}", None),
        ("load", "provenance/load_before/0", "{:.1f}", None),
        ("seeds", "provenance/seeds", "{}", lambda seeds: len(seeds)),
        ("stock", "runs/{arm=stock}/final_validation_loss", "{:.3f}", statistics.fmean),
    )
)


# -- peak memory per rank against stock DDP (benchmarks/memory/peak.py, docs/memory.md) ------------
MEMORY = Result(
    "results/memory/peak.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/memory/peak.py --json results/memory/peak.json",
)
MEMORY_ARMS = (("sgd", "SGD, momentum 0.9"), ("adamw", "AdamW"))
MEMORY_METHODS = ("none", "bf16", "topk", "sidco-exp", "efsignsgd", "powersgd", "diloco")
#: PowerSGD's rows, measured again once it left AdamW its moments (``peak.json`` is the others').
MEMORY_POWERSGD = Result(
    "results/memory/peak-powersgd.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/memory/peak.py --arms powersgd --json results/memory/peak-powersgd.json",
)


def _memory(optimizer: str, method: str, field: str, fmt: str = "{:.1f}") -> Claim:
    return Claim(f"memory.{optimizer}.{method}.{field}", MEMORY_POWERSGD if method == "powersgd" else MEMORY,
                 (f"rows/[arm={method},optimizer={optimizer}]/{field}",), fmt)  # fmt: skip


MEMORY_TABLE = Table(
    "memory-peak",
    ("optimizer", "method", "kept, expected", "kept, measured (malloc)", "peak, expected", "peak, measured (malloc)",
     "peak, measured (RSS)", "peak over the parameters' bytes (malloc / RSS)"),
    ("---", "---", "---:", "---:", "---:", "---:", "---:", "---:"),
    tuple(
        (label, f"`{method}`", _memory(optimizer, method, "expected_kept_per_parameter"),
         _memory(optimizer, method, "extra_allocated_end_per_parameter"),
         _memory(optimizer, method, "expected_peak_per_parameter"),
         _memory(optimizer, method, "extra_allocated_peak_per_parameter"),
         _memory(optimizer, method, "extra_peak_per_parameter"),
         (_memory(optimizer, method, "extra_allocated_peak_over_parameter_bytes", "{:.2f}x"), " / ",
          _memory(optimizer, method, "extra_peak_over_parameter_bytes", "{:.2f}x")))
        for optimizer, label in MEMORY_ARMS
        for method in MEMORY_METHODS
        if (optimizer, method) != ("sgd", "efsignsgd")
    ),
)  # fmt: skip
#: The same runs with glibc's mmap threshold fixed (docs/memory.md, the allocator note).
MEMORY_MMAP = Result(
    "results/memory/peak-mmap-threshold.json",
    "MALLOC_MMAP_THRESHOLD_=131072 flock /tmp/gradsift-cpu.lock python benchmarks/memory/peak.py "
    "--json results/memory/peak-mmap-threshold.json",
)


def _memory_mmap(method: str, field: str) -> Claim:
    return Claim(f"memory.mmap.sgd.{method}.{field}", MEMORY_MMAP,
                 (f"rows/[arm={method},optimizer=sgd]/{field}",), "{:.2f}x")  # fmt: skip


#: SGD's sparsifiers at two model widths, one commit: the per-parameter slope between them.
MEMORY_SIZES = {
    width: Result(f"results/memory/peak-sgd-w{width}.json",
                  f"flock /tmp/gradsift-cpu.lock python benchmarks/memory/peak.py --width {width} --optimizers sgd "
                  f"--arms topk sidco-exp --json results/memory/peak-sgd-w{width}.json")
    for width in (1024, 2048)
}  # fmt: skip


def _memory_slope(method: str) -> Claim:
    """``method``'s live peak over stock DDP between the two widths, over the parameters' bytes
    it added: ``(r_L B_L - r_S B_S) / (B_L - B_S)`` for ratios ``r`` to the parameters' bytes
    ``B``, the part that grows with the model."""
    small, large = MEMORY_SIZES[1024], MEMORY_SIZES[2048]
    row = f"rows/[arm={method},optimizer=sgd]/extra_allocated_peak_over_parameter_bytes"
    return Claim(f"memory.sizes.{method}.slope", small,
                 (row, "parameter_bytes", (large, row), (large, "parameter_bytes")),
                 "{:.2f}x", compute=lambda r_s, b_s, r_l, b_l: (r_l * b_l - r_s * b_s) / (b_l - b_s))  # fmt: skip


MEMORY_SIZE_CLAIMS = (
    Claim("memory.sizes.commit", MEMORY_SIZES[1024], ("provenance/commit",), "{:.7}"),
    Claim("memory.sizes.large_parameters", MEMORY_SIZES[2048], ("parameters",), "{:,}"),
    *(Claim(f"memory.sizes.{method}.w{width}", MEMORY_SIZES[width],
            (f"rows/[arm={method},optimizer=sgd]/extra_allocated_peak_over_parameter_bytes",), "{:.2f}x")
      for method in ("topk", "sidco-exp") for width in (1024, 2048)),
    *(_memory_slope(method) for method in ("topk", "sidco-exp")),
)  # fmt: skip
#: The threshold's price: the step with and without it, paired per round, and the RSS it saves.
MEMORY_COST = Result(
    "results/memory/threshold-cost.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/memory/threshold_cost.py --rounds 5 --json results/memory/threshold-cost.json",
)


def _claim_key(words: str) -> str:
    """``threshold fixed, huge pages/step_ms`` -> ``threshold_fixed.huge_pages.step_ms``."""
    return words.replace("/", ".").replace(", ", ".").replace(" ", "_")


def _memory_cost(arm: str, field: str, fmt: str = "{:.2f}x") -> Claim:
    return Claim(f"memory.cost.{arm}.{_claim_key(field)}", MEMORY_COST,
                 (f"arms/{arm}/{field}",), fmt)  # fmt: skip


def _memory_cost_ratio(arm: str, setting: str = "threshold fixed") -> Claim:
    ratio = f"arms/{arm}/step_over_defaults/{setting}/"
    name = "ratio" if setting == "threshold fixed" else f"ratio.{_claim_key(setting)}"
    return Claim(f"memory.cost.{arm}.{name}", MEMORY_COST, (f"{ratio}mean", f"{ratio}low", f"{ratio}high"),
                 "{:.2f}x [{:.2f}, {:.2f}]", compute=lambda *v: v)  # fmt: skip


_HUGE = "threshold fixed, huge pages"
MEMORY_COST_TABLE = Table(
    "memory-threshold-cost",
    ("method", "median step, glibc's defaults", "threshold fixed", "fixed, huge pages",
     "fixed / defaults, paired (95 %)", "fixed, huge pages / defaults", "peak RSS over stock DDP, defaults",
     "fixed", "fixed, huge pages"),
    ("---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:"),
    tuple(
        (f"`{arm}`", *(_memory_cost(arm, f"{setting}/step_ms", "{:.0f} ms")
                       for setting in ("glibc defaults", "threshold fixed", _HUGE)),
         _memory_cost_ratio(arm), _memory_cost_ratio(arm, _HUGE),
         *(_memory_cost(arm, f"{setting}/extra_rss_over_parameter_bytes")
           for setting in ("glibc defaults", "threshold fixed", _HUGE)))
        for arm in ("topk", "sidco-exp")
    ),
)  # fmt: skip


MEMORY_CLAIMS = (
    Claim("memory.cost.commit", MEMORY_COST, ("provenance/commit",), "{:.7}"),
    Claim("memory.cost.rounds", MEMORY_COST, ("args/rounds",)),
    Claim("memory.cost.load", MEMORY_COST, ("provenance/load_before/0", "provenance/load_after/0"),
          "{:.1f} before / {:.1f} after", compute=lambda *v: v),
    _memory_cost_ratio("stock"),
    _memory_cost_ratio("stock", _HUGE),
    *(_memory_cost("stock", f"{setting}/step_ms", "{:.0f} ms") for setting in ("glibc defaults", "threshold fixed", _HUGE)),
    Claim("memory.mmap.threshold", MEMORY_MMAP, ("allocator/MALLOC_MMAP_THRESHOLD_",)),
    Claim("memory.mmap.commit", MEMORY_MMAP, ("provenance/commit",), "{:.7}"),
    *(_memory_mmap(method, field) for method in ("topk", "sidco-exp")
      for field in ("extra_allocated_peak_over_parameter_bytes", "extra_peak_over_parameter_bytes")),
    Claim("memory.commit", MEMORY, ("provenance/commit",), "{:.7}"),
    Claim("memory.powersgd.commit", MEMORY_POWERSGD, ("provenance/commit",), "{:.7}"),
    load_claim("memory.powersgd.load", MEMORY_POWERSGD, "{:.1f} before / {:.1f} after"),
    Claim("memory.load", MEMORY, ("provenance/load_before/0", "provenance/load_after/0"),
          "{:.1f} before / {:.1f} after", compute=lambda *v: v),
    Claim("memory.seeds", MEMORY, ("provenance/seeds",), compute=lambda seeds: ", ".join(map(str, seeds))),
    Claim("memory.steps", MEMORY, ("args/steps",)),
    Claim("memory.parameters", MEMORY, ("parameters",), "{:,}"),
    Claim("memory.parameter_mb", MEMORY, ("parameter_bytes",), "{:.1f} MB", compute=lambda b: b / 1e6),
    Claim("memory.largest_bucket", MEMORY, ("rows/[arm=topk,optimizer=sgd]/largest_bucket",), "{:,}"),
    Claim("memory.sizes.large_bucket", MEMORY_SIZES[2048], ("rows/[arm=topk,optimizer=sgd]/largest_bucket",), "{:,}"),
)  # fmt: skip


# -- the README's verdict: one row per setting, its figures the claims its pages publish -----------
_PUBLISHED = {
    c.id: c for c in (*TRAINING_CLAIMS, *TRAINING_SEEDS_CLAIMS, *VERDICT_CLAIMS, *HOOK_CLAIMS, *AUTO_CLAIMS)
}
AUTO_LOCALHOST = AUTO_LINKS[0][2]


# -- auto against every fixed candidate per link: 40-step timings (issue 42's link matrix) ----------
AUTO_MATRIX = Result(
    "results/auto/links.json",
    "flock /tmp/gradsift-cpu.lock python benchmarks/auto/links.py --json results/auto/links.json",
)
AUTO_MATRIX_ROWS = tuple(
    (link, workload)
    for link in ("localhost", "1gbit", "100mbit", "10mbit")
    for workload in ("vgg", "gpt-adamw")
)


AUTO_WORKLOADS = {"vgg": "VGG + SGD, 4 workers", "gpt-adamw": "GPT + AdamW, 2 workers"}
_AUTO_LINKS_COLUMNS = ("link", "workload", "fastest fixed candidate", "its median step", "auto chose",
                       "auto's median step", "auto / fastest")  # fmt: skip


def _links_table(
    name: str,
    result: Result,
    prefix: str,
    rows: tuple[tuple[str, str], ...],
    chose: tuple[str, Any],
    last: tuple[str, str],
) -> tuple[Table, tuple[Claim, ...]]:
    """A ``links.py`` result as a table -- per row the fastest fixed candidate and its median step,
    what ``auto`` chose (``chose``: the summary field and how it reads), its median step, its ratio
    to the fastest and ``last`` (heading, summary field) -- and the result's stamp claims."""
    field, shown = chose

    def cell(i: int, key: str, paths: tuple[str, ...], fmt: str = "{:.3f}x", compute: Any = None) -> Claim:
        link, workload = rows[i]
        return Claim(f"{prefix}.{link}.{workload}.{key}", result, tuple(f"rows/{i}/{p}" for p in paths), fmt,
                     compute=compute)  # fmt: skip

    table = Table(
        name, (*_AUTO_LINKS_COLUMNS, last[0]), ("---", "---", "---", "---:", "---", "---:", "---:", "---:"),
        tuple(
            (link, AUTO_WORKLOADS[workload],
             cell(i, "fastest", ("summary/fastest_fixed",), "`{}`"),
             cell(i, "fastest_ms", ("summary/fastest_fixed", "runs"), "{:.0f} ms",
                  lambda name, runs: 1e3 * runs[name]["step_time_median_s"]),
             cell(i, "chose", (f"summary/{field}",), "{}", compute=shown),
             cell(i, "auto_ms", ("runs/auto/step_time_median_s",), "{:.0f} ms", lambda seconds: 1e3 * seconds),
             cell(i, "over_fastest", ("summary/auto_over_fastest",)),
             cell(i, last[1], (f"summary/{last[1]}",)))
            for i, (link, workload) in enumerate(rows)
        ),
    )  # fmt: skip
    stamp = (
        Claim(f"{prefix}.commit", result, ("provenance/commit",), "{:.7}"),
        Claim(f"{prefix}.load", result, ("provenance/load_before/0", "provenance/load_after/0"),
              "{:.1f} before / {:.1f} after", compute=lambda *v: v),
    )  # fmt: skip
    return table, stamp


AUTO_MATRIX_TABLE, _AUTO_MATRIX_STAMP = _links_table(
    "auto-links", AUTO_MATRIX, "autolinks", AUTO_MATRIX_ROWS, ("auto_choice", lambda name: f"`{name}`"),
    ("auto / fp32", "auto_over_none"),
)  # fmt: skip
AUTO_MATRIX_CLAIMS = (*_AUTO_MATRIX_STAMP, Claim("autolinks.steps", AUTO_MATRIX, ("steps",)))

# -- the rows of auto-links within noise of another arm, repeated (issue 42) ------------------------
AUTO_REPEATED = Result(
    "results/auto/links-repeated.json",
    "python benchmarks/auto/links.py --links localhost 1gbit 100mbit --workloads vgg --repeats 5 "
    "--json results/auto/links-repeated.json",
)
AUTO_REPEATED_ROWS = (("localhost", "vgg"), ("1gbit", "vgg"), ("100mbit", "vgg"))


AUTO_REPEATED_TABLE, _AUTO_REPEATED_STAMP = _links_table(
    "auto-links-repeated", AUTO_REPEATED, "autorepeated", AUTO_REPEATED_ROWS,
    ("auto_choices", lambda names: ", ".join(f"`{n}`" for n in names)),
    ("auto / fastest, from its decision on", "settled_auto_over_fastest"),
)  # fmt: skip
AUTO_REPEATED_CLAIMS = (*_AUTO_REPEATED_STAMP, Claim("autorepeated.repeats", AUTO_REPEATED, ("repeats",)))


def _worst_step(single: list[dict[str, Any]], repeated: list[dict[str, Any]]) -> float:
    """``auto``'s largest median step over the fastest fixed candidate's across the link rows,
    each row's repeated measurement replacing its single run where there is one."""
    rows = {(r["link"], r["workload"]): r["auto_over_fastest"] for r in single}
    rows.update({(r["link"], r["workload"]): r["auto_over_fastest"] for r in repeated})
    return max(rows.values())


# -- auto's time to the target per link, composed from curves and step times (issue 42) -------------
AUTO_TTA = Result("results/auto/time_to_target.json", "python benchmarks/auto/time_to_target.py")


def _tta_seconds(mean: float | None, reached: int, seeds: list[int]) -> str:
    """A mean time to the target over the seeds that reached it, ``(k/n seeds)`` where not all did."""
    count = "" if reached == len(seeds) else f" ({reached}/{len(seeds)} seeds)"
    return "not reached" if mean is None else f"{mean:.1f} s{count}"


def _tta_ratio(summary: dict[str, Any]) -> str:
    """A paired ratio's mean, with its 95 % t-interval where two seeds or more reached the target."""
    if summary["mean"] is None:
        return "not reached"
    interval = "" if summary["low"] is None else f" [{summary['low']:.3f}, {summary['high']:.3f}]"
    return f"{summary['mean']:.3f}x{interval}"


def _tta_steps(*per_seed: list[int | None]) -> str:
    """Steps to the target (mean over the seeds that reached it), joined by `` / ``."""
    means = [[n for n in steps if n is not None] for steps in per_seed]
    return " / ".join(f"{statistics.fmean(m):.0f}" if m else "not reached" for m in means)


def _link_row(
    result: Result,
    prefix: str,
    link: str,
    workload: str,
    key: str,
    paths: tuple[str, ...],
    compute: Any = None,
    fmt: str = "{}",
) -> Claim:
    """A claim on the row of ``result`` for ``link`` and ``workload`` (the fields at ``paths``)."""
    row = f"rows/[link={link},workload={workload}]"
    return Claim(
        f"{prefix}.{link}.{workload}.{key}", result, tuple(f"{row}/{p}" for p in paths), fmt, compute=compute
    )


_tta = functools.partial(_link_row, AUTO_TTA, "autotta")


def _tta_links(commit: str, composed_from: str, measured: str) -> str:
    """The commit of the links.json the composition read -- or, once links.json is re-measured
    and the composition not re-run, a line that says so in its place."""
    return f"{commit:.7}" if composed_from == measured else "STALE: re-run benchmarks/auto/time_to_target.py"


AUTO_TTA_TABLE = Table(
    "auto-time-to-target",
    ("link", "workload", "fastest fixed to the target", "steps to the target: fastest / fp32 / auto",
     "fastest's time", "fp32's time", "auto chose", "auto's time", "auto's one-off: measuring steps + probes",
     "auto / fastest", "auto / fp32"),
    ("---", "---", "---", "---:", "---:", "---:", "---", "---:", "---:", "---:", "---:"),
    tuple(
        (link, AUTO_WORKLOADS[workload],
         _tta(link, workload, "fastest", ("best_fixed/names",), lambda names: ", ".join(f"`{n}`" for n in names)),
         _tta(link, workload, "steps", ("best_fixed/steps_to_target", "fixed/none/steps_to_target",
                                        "auto/steps_to_target"), _tta_steps),
         *(_tta(link, workload, f"{part}_s", (f"{path}/mean_s", f"{path}/reached", "seeds"), _tta_seconds)
           for part, path in (("fastest", "best_fixed"), ("fp32", "fixed/none"))),
         _tta(link, workload, "choice", ("auto/choice",), None, "`{}`"),
         _tta(link, workload, "auto_s", ("auto/mean_s", "auto/reached", "seeds"), _tta_seconds),
         _tta(link, workload, "one_off", ("auto/one_off_s", "auto/probe_s"),
              lambda one_off, probes: (statistics.fmean(v for v in one_off if v is not None), probes),
              "{:.2f} s (probes {:.2f} s)"),
         _tta(link, workload, "over_fastest", ("auto_over_best_fixed",), _tta_ratio),
         _tta(link, workload, "over_fp32", ("auto_over_none",), _tta_ratio))
        for link, workload in AUTO_MATRIX_ROWS
    ),
)  # fmt: skip
AUTO_TTA_CLAIMS = (
    Claim("autotta.links", AUTO_TTA, ("inputs/links/commit", "inputs/links/started", (AUTO_MATRIX, "provenance/started")),
          compute=_tta_links),
    Claim("autotta.vgg.same", AUTO_TTA, ("inputs/vgg_curves/link_independent",),
          compute=lambda same: "the same, evaluation for evaluation" if same else "NOT the same"),
    Claim("autotta.vgg.target", AUTO_TTA, ("targets/vgg/target",), "{:.2f}%", compute=lambda a: 100 * a),
    Claim("autotta.gpt.target", AUTO_TTA, ("targets/gpt-adamw/target",), "{:.3f}"),
    Claim("autotta.probe_calls", AUTO_TTA, ("rules/probe_calls_per_candidate",)),
    Claim("autotta.probe_format", AUTO_TTA, ("inputs/links/probe_format",),
          compute=lambda formats: " or ".join({"route": "each candidate's whole route",
                                               "route, probes' wall time measured":
                                                   "each candidate's whole route, the probes' wall time measured",
                                               "message+codec": "message plus codec"}[f] for f in formats)),
    Claim("autotta.decided_at", AUTO_TTA, ("rows/*/auto/decided_at",), compute=spanned(".0f")),
    Claim("autotta.vgg.more_seeds", AUTO_TTA, ("targets/vgg/more_seeds",), compute=lambda more: "; ".join(
        f"seed {seed}: `sidco-exp` at step {more['steps_to_target']['sidco-exp'][i]}, fp32 at "
        f"{more['steps_to_target']['none'][i]}" for i, seed in enumerate(more["seeds"]))),
)  # fmt: skip

# -- the controls of the VGG row auto misses (issue 42) -------------------------------------------
AUTO_VGG_CONTROLS = Result(
    "results/auto/vgg_controls.json",
    "python benchmarks/auto/vgg_controls.py --arms alone --json results/auto/vgg_controls.json "
    "(the other arms' runs in results/auto/vgg_controls/, then --summarize-only)",
)
AUTO_VGG_CONTROL_ROWS = (
    ("fp32 allreduce (stock DDP, `none`)", "none"),
    ("`bf16`", "bf16"),
    ("`sidco-exp` at 0.01, DGC's recipe (the fixed candidate)", "sidco-exp"),
    ("the method run dense: `topk` at ratio 1, DGC's recipe", "topk-dense"),
    ("`sidco-exp` at 0.01 without the recipe (plain error feedback, SGD's momentum)", "sidco-exp-no-recipe"),
    ("one worker alone (its own batch, no communication)", "alone"),
)


def _steps_per_seed(*steps: int | None) -> str:
    return ", ".join("-" if step is None else str(step) for step in steps)


def _mean_steps_ratio(ours: list[int | None], fp32: list[int | None]) -> str:
    """The mean steps to the target over the seeds where both reached it, ours over fp32's."""
    both = [(a, b) for a, b in zip(ours, fp32, strict=True) if a is not None and b is not None]
    if not both:
        return "no seed where both reached it"
    return f"{statistics.fmean(a for a, _ in both) / statistics.fmean(b for _, b in both):.2f}x"


def _bytes_sent_received(*values: float) -> str | None:
    """The first half of ``values`` per seed sent, the second received: their means in MB (None:
    nothing received, a worker alone)."""
    sent, received = (
        statistics.fmean(values[: len(values) // 2]),
        statistics.fmean(values[len(values) // 2 :]),
    )
    return None if received == 0 else f"{sent / 1e6:.2f} / {received / 1e6:.2f} MB"


AUTO_VGG_CONTROLS_TABLE = Table(
    "auto-vgg-controls",
    ("run (VGG + SGD, 4 workers, 200 steps)", "steps to the target, seeds 0-4 (-: not in 200)",
     "mean accuracy from step 100 (5 seeds)", "vs fp32, paired (points, 95 % interval)",
     "sent / received per worker per step (5 seeds)"),
    ("---", "---:", "---:", "---:", "---:"),
    tuple(
        (label,
         Claim(f"autovggctl.{key}.steps", AUTO_VGG_CONTROLS,
               tuple(f"arms/{key}/{seed}/steps_to_target" for seed in range(5)), compute=_steps_per_seed),
         Claim(f"autovggctl.{key}.late", AUTO_VGG_CONTROLS,
               tuple(f"arms/{key}/{seed}/late_mean_accuracy" for seed in range(5)), "{:.1%}",
               compute=lambda *values: statistics.fmean(values)),
         "-" if key == "none" else
         Claim(f"autovggctl.{key}.versus", AUTO_VGG_CONTROLS,
               tuple(f"late_points_vs_none/{key}/{f}" for f in ("mean", "low", "high")), "{:+.2f} [{:+.2f}, {:+.2f}]",
               compute=lambda *values: values),
         Claim(f"autovggctl.{key}.bytes", AUTO_VGG_CONTROLS,
               tuple(f"arms/{key}/{seed}/bytes_{way}_per_step" for way in ("sent", "received") for seed in range(5)),
               "{}", compute=_bytes_sent_received, missing="nothing: one worker"))
        for label, key in AUTO_VGG_CONTROL_ROWS
    ),
)  # fmt: skip
#: The two training batches' own stamps, kept beside their runs.
AUTO_VGG_CONTROL_BATCHES = {
    "controls": Result(
        "results/auto/vgg_controls/provenance-topk-dense-sidco-exp-no-recipe.json",
        "python benchmarks/auto/vgg_controls.py --arms topk-dense sidco-exp-no-recipe",
    ),
    "alone": Result(
        "results/auto/vgg_controls/provenance-alone.json",
        "python benchmarks/auto/vgg_controls.py --arms alone",
    ),
}
AUTO_VGG_CONTROLS_CLAIMS = (
    Claim("autovggctl.target", AUTO_VGG_CONTROLS, ("target",), "{:.1%}"),
    *(
        claim
        for name, batch in AUTO_VGG_CONTROL_BATCHES.items()
        for claim in (
            Claim(f"autovggctl.{name}.commit", batch, ("provenance/commit",), "{:.7}"),
            Claim(
                f"autovggctl.{name}.load",
                batch,
                ("provenance/load_before/0", "provenance/load_after/0"),
                "{:.1f} before / {:.1f} after",
                compute=lambda *v: v,
            ),
        )
    ),
)


# -- the VGG composition at five times the length (issue 42) -------------------------------------------
AUTO_VGG_LONGER = Result(
    "results/auto/vgg_longer.json",
    "python benchmarks/auto/vgg_longer.py analyze --json results/auto/vgg_longer.json "
    "(the runs in results/auto/vgg_longer/, from `nice -n 19 python benchmarks/auto/vgg_longer.py run`)",
)
_longer = functools.partial(_link_row, AUTO_VGG_LONGER, "autolonger")
AUTO_VGG_LONGER_TABLE = Table(
    "auto-vgg-longer",
    ("link (VGG + SGD, 4 workers, 1,000 steps)", "fastest fixed to the target", "steps to the target: fastest / fp32 / auto",
     "auto chose", "auto / fastest", "auto / fp32"),
    ("---", "---", "---:", "---", "---:", "---:"),
    tuple(
        (link,
         _longer(link, "vgg", "fastest", ("best_fixed/names",), lambda names: ", ".join(f"`{n}`" for n in names)),
         _longer(link, "vgg", "steps", ("best_fixed/steps_to_target", "fixed/none/steps_to_target",
                                        "auto/steps_to_target"), _tta_steps),
         _longer(link, "vgg", "choice", ("auto/choice",), None, "`{}`"),
         _longer(link, "vgg", "over_fastest", ("auto_over_best_fixed",), _tta_ratio),
         _longer(link, "vgg", "over_fp32", ("auto_over_none",), _tta_ratio))
        for link in ("localhost", "1gbit", "100mbit", "10mbit")
    ),
)  # fmt: skip


def _per_step_row(result: Result, prefix: str, label: str, key: str) -> tuple[str | Claim, ...]:
    """A row of a 1,000-step run's arms (``vgg_longer.per_step``): steps to the target per seed,
    the second half's mean accuracy, and its paired difference from fp32's."""
    return (
        label,
        Claim(f"{prefix}.{key}.steps", result, (f"steps_to_target/{key}",), compute=lambda steps: _steps_per_seed(*steps)),
        Claim(f"{prefix}.{key}.late", result, (f"second_half_accuracy/{key}",), "{:.1%}", compute=statistics.fmean),
        "-" if key == "none" else
        Claim(f"{prefix}.{key}.versus", result,
              tuple(f"second_half_points_vs_none/{key}/{f}" for f in ("mean", "low", "high")),
              "{:+.2f} [{:+.2f}, {:+.2f}]", compute=lambda *values: values),
    )  # fmt: skip


AUTO_VGG_LONGER_ARMS_TABLE = Table(
    "auto-vgg-longer-arms",
    ("run (VGG + SGD, 4 workers, 1,000 steps)", "steps to the target, seeds 0-4 (-: not in 1,000)",
     "mean accuracy over steps 550-1,000 (5 seeds)", "vs fp32, paired (points, 95 % interval)"),
    ("---", "---:", "---:", "---:"),
    tuple(_per_step_row(AUTO_VGG_LONGER, "autolonger", label, key) for label, key in AUTO_VGG_CONTROL_ROWS[:3]),
)  # fmt: skip
#: Each seed's training batch, stamped where it ran (a resumed batch by the commit it resumed from).
_LONGER_BATCHES = tuple(
    Result(
        f"results/auto/vgg_longer/provenance-s{seed}.json",
        "nice -n 19 python benchmarks/auto/vgg_longer.py run",
    )
    for seed in range(5)
)
AUTO_VGG_LONGER_CLAIMS = (
    Claim("autolonger.target", AUTO_VGG_LONGER, ("target",), "{:.1%}"),
    Claim("autolonger.fp32_final", AUTO_VGG_LONGER, ("fp32_final",), "{:.1%}"),
    Claim("autolonger.commit", AUTO_VGG_LONGER, ("provenance/commit",), "{:.7}"),
    _longer("localhost", "vgg", "sidco_over_none_step", ("step_time_median_s",),
            lambda step: step["sidco-exp"] / step["none"], "{:.3f}x"),
    _longer("localhost", "vgg", "sidco_over_none_steps", ("fixed/sidco-exp/steps_to_target", "fixed/none/steps_to_target"),
            _mean_steps_ratio),
    Claim("autolonger.runs.commit", _LONGER_BATCHES[0],
          ("provenance/commit", *((batch, "provenance/commit") for batch in _LONGER_BATCHES[1:])),
          compute=lambda *commits: ", ".join(sorted({f"{c:.7}" for c in commits}))),
)  # fmt: skip


# -- the per-step lead on a second CNN: ResNet-20 with the VGG composition's flags (issue 42) ----------
SECOND_CNN = Result(
    "results/auto/second_cnn.json",
    "python benchmarks/auto/second_cnn.py analyze --json results/auto/second_cnn.json "
    "(the runs in results/auto/second_cnn/, from `nice -n 19 python benchmarks/auto/second_cnn.py run`)",
)
SECOND_CNN_ROWS = tuple(row for row in AUTO_VGG_CONTROL_ROWS if row[1] != "bf16")
SECOND_CNN_TABLE = Table(
    "second-cnn",
    ("run (ResNet-20 + SGD, 4 workers, 1,000 steps)", "steps to the target, seeds 0-2 (-: not in 1,000)",
     "mean accuracy over steps 550-1,000 (3 seeds)", "vs fp32, paired (points, 95 % interval)",
     "sent / received per worker and step"),
    ("---", "---:", "---:", "---:", "---:"),
    tuple(
        (*_per_step_row(SECOND_CNN, "secondcnn", label, key),
         Claim(f"secondcnn.{key}.bytes", SECOND_CNN, (f"bytes_per_step/{key}/sent", f"bytes_per_step/{key}/received"),
               compute=lambda sent, received: _bytes_sent_received(*sent, *received) or "none (alone)"))
        for label, key in SECOND_CNN_ROWS
    ),
)  # fmt: skip
#: Each seed's training batches: the candidates first, the controls in a later batch.
_SECOND_CNN_BATCHES = tuple(
    Result(f"results/auto/second_cnn/provenance-s{seed}{batch}.json", "nice -n 19 python benchmarks/auto/second_cnn.py run")
    for seed in range(3)
    for batch in ("", "-2")
)  # fmt: skip


SECOND_CNN_CLAIMS = (
    Claim("secondcnn.target", SECOND_CNN, ("target",), "{:.1%}"),
    Claim("secondcnn.fp32_final", SECOND_CNN, ("fp32_final",), "{:.1%}"),
    Claim("secondcnn.commit", SECOND_CNN, ("provenance/commit",), "{:.7}"),
    Claim("secondcnn.sidco_over_none_steps", SECOND_CNN, ("steps_to_target/sidco-exp", "steps_to_target/none"),
          compute=_mean_steps_ratio),
    Claim("secondcnn.runs.commit", _SECOND_CNN_BATCHES[0],
          ("provenance/commit", *((batch, "provenance/commit") for batch in _SECOND_CNN_BATCHES[1:])),
          compute=lambda *commits: ", ".join(sorted({f"{c:.7}" for c in commits}))),
)  # fmt: skip


# -- one whole run of auto per link, beside its composed time to the target (issue 42) ---------------
AUTO_WHOLE = Result(
    "results/auto/whole.json", "python benchmarks/auto/whole.py --json results/auto/whole.json"
)


_whole = functools.partial(_link_row, AUTO_WHOLE, "autowhole")


def _whole_time(seconds: float | None, step: int | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f} s (step {step})"


def _whole_ratio(ratio: float | None, agree: bool | None) -> str:
    return "-" if ratio is None else f"{ratio:.3f}x ({'agree' if agree else 'DISAGREE'})"


AUTO_WHOLE_TABLE = Table(
    "auto-whole",
    ("link", "workload", "auto chose: whole run / composed", "time to the target: whole run",
     "composed (seed 0)", "whole / composed"),
    ("---", "---", "---", "---:", "---:", "---:"),
    tuple(
        (link, AUTO_WORKLOADS[workload],
         _whole(link, workload, "choice", ("choice", "composed_choice"), lambda a, b: f"`{a}` / `{b}`"),
         _whole(link, workload, "measured", ("time_to_target_s", "steps_to_target"), _whole_time),
         _whole(link, workload, "composed", ("composed_s",), lambda s: "not reached" if s is None else f"{s:.1f} s"),
         _whole(link, workload, "ratio", ("measured_over_composed", "agree"), _whole_ratio))
        for link, workload in AUTO_MATRIX_ROWS
    ),
)  # fmt: skip
AUTO_WHOLE_CLAIMS = (
    Claim("autowhole.commit", AUTO_WHOLE, ("provenance/commit",), "{:.7}"),
    Claim("autowhole.load", AUTO_WHOLE, ("provenance/load_before/0", "provenance/load_after/0"),
          "{:.1f} before / {:.1f} after", compute=lambda *v: v),
    Claim("autowhole.agree", AUTO_WHOLE, ("agree_within",), "{:.0f} %", compute=lambda a: 100 * a),
)  # fmt: skip

# -- auto and the fixed candidate it chose, each run whole in one session (issue 42) ------------------
AUTO_BESIDE = Result(
    "results/auto/whole-beside-fixed.json",
    "python benchmarks/auto/whole.py --links 100mbit 10mbit --workloads vgg --compressors auto sidco-exp "
    "--json results/auto/whole-beside-fixed.json",
)
AUTO_BESIDE_LINKS = ("100mbit", "10mbit")


def _beside(link: str, key: str, fields: tuple[str, ...], compute: Any, fmt: str = "{}") -> Claim:
    """A claim on the ``auto`` and ``sidco-exp`` runs of ``link`` (each field, a list over the
    runs, read from both arms)."""
    paths = tuple(
        f"rows/{{link={link},compressor={arm}}}/{field}" for field in fields for arm in ("auto", "sidco-exp")
    )
    return Claim(f"autobeside.{link}.{key}", AUTO_BESIDE, paths, fmt, compute=compute)


def _median_time(seconds: list[float | None], steps: list[int | None]) -> str:
    """The median time to the target over the runs, with their steps and count."""
    if None in seconds:
        return "not reached in every run"
    return f"{statistics.median(seconds):.1f} s (steps {'/'.join(map(str, steps))}; {len(seconds)} runs)"


def _paired_ratio(auto: list[float | None], fixed: list[float | None]) -> str:
    """The median over the run pairs (in order) of auto's time over the fixed arm's, and the range."""
    if None in auto or None in fixed:
        return "-"
    ratios = [a / f for a, f in zip(auto, fixed, strict=True)]
    return f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})"


AUTO_BESIDE_TABLE = Table(
    "auto-whole-beside-fixed",
    ("link", "workload", "auto chose", "auto's time to the target", "`sidco-exp`'s", "auto / `sidco-exp`, per pair",
     "the same evaluations"),
    ("---", "---", "---", "---:", "---:", "---:", "---"),
    tuple(
        (link, AUTO_WORKLOADS["vgg"],
         _beside(link, "choice", ("choice",), lambda auto, fixed: ", ".join(f"`{c}`" for c in sorted(set(auto)))),
         _beside(link, "auto", ("time_to_target_s", "steps_to_target"), lambda a, f, sa, sf: _median_time(a, sa)),
         _beside(link, "fixed", ("time_to_target_s", "steps_to_target"), lambda a, f, sa, sf: _median_time(f, sf)),
         _beside(link, "ratio", ("time_to_target_s",), _paired_ratio),
         _beside(link, "same", ("curve",),
                 lambda a, f: "yes, every evaluation of every run" if all(c == f[0] for c in a + f) else "no"))
        for link in AUTO_BESIDE_LINKS
    ),
)  # fmt: skip
AUTO_BESIDE_CLAIMS = (
    Claim("autobeside.commit", AUTO_BESIDE, ("provenance/commit",), "{:.7}"),
    Claim("autobeside.load", AUTO_BESIDE, ("provenance/load_before/0", "provenance/load_after/0"),
          "{:.1f} before / {:.1f} after", compute=lambda *v: v),
)  # fmt: skip


def _seeds(setting: str, result: Result, path: str) -> Claim:
    """How many seeds the list at ``path`` names."""
    return Claim(f"readme.{setting}.seeds", result, (path,), compute=len)


VERDICT_TABLE = Table(
    "readme-verdict",
    ("your setting", "what to use", "what it buys", "measured on", "seeds"),
    ("---", "---", "---", "---", "---"),
    (
        ("slow link + SGD",
         "`sidco-exp` at ratio 0.01 with DGC's momentum correction: the one line's pick for SGD where it predicts "
         "it faster",
         (_PUBLISHED["trainseeds.sidco.sooner.none"], " sooner than fp32 DDP and ",
          _PUBLISHED["trainseeds.sidco.sooner.bf16"], " sooner than `bf16` to fp32's final test accuracy minus one "
          "point (paired per seed), ending ", _PUBLISHED["trainseeds.sidco.points"], " points from fp32's accuracy, "
          "with ", _PUBLISHED["trainseeds.sidco.factor"], " fewer bytes"),
         "VGG-style CNN, 4 workers, 200 steps, emulated 100 Mbit/s ([benchmarks/training](benchmarks/training/README.md))",
         _seeds("sgd", TRAINING_SEEDS, "provenance/seeds")),
        ("slow link + AdamW",
         "the 1-bit Adam method (`efsignsgd` under AdamW): a candidate of the one line in runs known to last "
         "3,000 steps or more (`steps=`); in shorter ones it picks `bf16` or stock DDP",
         (_PUBLISHED["verdict.adamw3k.onebit-adam.sooner.none"], " sooner than fp32 DDP and ",
          _PUBLISHED["verdict.adamw3k.onebit-adam.sooner.bf16"], " sooner than `bf16` to fp32's final validation "
          "loss + 1 %, with ", _PUBLISHED["verdict.adamw3k.onebit-adam.fewer"], " fewer bytes"),
         "small GPT, 2 workers, 3,000 steps, times over emulated 100 Mbit/s ([docs/adam.md](docs/adam.md))",
         _seeds("adamw", CONVERGENCE, "workloads/gpt-adamw-3k/methods/onebit-adam/seeds")),
        ("fast link",
         "the one line: it keeps stock DDP's allreduce",
         ("nothing to buy: on localhost the one line kept stock DDP on ",
          Claim("readme.fast.kept", AUTO_LOCALHOST, ("runs/{arm=auto}/auto/choice",), "{}/{}",
                compute=lambda choices: (choices.count("none"), len(choices))),
          " seeds, at stock's loss; a named compressor costs step time: `sidco-exp` ",
          _verdict_hook_cost("sidco-exp@0.01"), " stock DDP's step, `none` ", _verdict_hook_cost("none"),
          " (medians of five runs, their range)"),
         "localhost gloo: a small GPT with AdamW, 2 workers ([docs/auto.md](docs/auto.md)); the hook's cost on an "
         "MLP ([benchmarks/hook_overhead](benchmarks/hook_overhead/README.md))",
         (_PUBLISHED["auto.localhost.seeds"], " (the one line); 5 runs (the hook's cost)")),
        ("any link, unknown to you",
         "the one line, `register_comm_hook(ddp)`: it times your first steps (on `sidco-exp` under SGD, on stock "
         "DDP under AdamW), probes each candidate on your group and runs the fastest that keeps quality for your "
         "optimizer",
         ("its median step within ",
          Claim("readme.auto.step_worst", AUTO_MATRIX, ("rows/*/summary", (AUTO_REPEATED, "rows/*/summary")),
                "{:.3f}x", compute=_worst_step),
          " of the fastest fixed candidate's on every emulated link, its measuring steps included; its time to "
          "the target within ",
          Claim("readme.auto.tta_gpt", AUTO_TTA, ("rows/{workload=gpt-adamw}/auto_over_best_fixed/mean",),
                compute=spanned(".3f")),
          "x of the fastest's with the GPT, ",
          Claim("readme.auto.tta_vgg", AUTO_TTA, ("rows/{workload=vgg}/auto_over_best_fixed/mean",),
                compute=spanned(".2f")),
          "x with VGG's 200-step runs (the most where it keeps stock DDP on localhost: there `sidco-exp` reached "
          "the target in fewer steps)"),
         "VGG-style CNN on 4 workers and a small GPT on 2, localhost and emulated 1 Gbit/s, 100 and 10 Mbit/s "
         "([docs/auto.md](docs/auto.md))",
         "1 (step times; 5 runs per arm where one run was within noise); 3 (curves)"),
        ("GPU",
         "the one line (stock DDP where the link is fast); the compressed methods run but are not tuned for GPUs",
         "no speed gain measured yet: the device check passes (every compressor x exchange at one host read per "
         "step at most, sums in rank order that repeat their bits); on one rank and a small MLP the hook's step is "
         "slower than stock DDP's (its Python per bucket)",
         "one H200, torch 2.11, CUDA 13.0, NCCL, one rank, commit b7ddd55 "
         "([results/gpu](results/gpu/check-b7ddd55/README.md))",
         "-"),
    ),
)  # fmt: skip

TABLES = (
    TRAINING_SEEDS_TABLE,
    TRAINING_SCALING_TABLE,
    QUANTIZER_TABLE,
    BITPACK_TABLE,
    BITPACK_QSGD_TABLE,
    CROSSOVER_TABLE,
    HOOK_TABLE,
    HOOK_SPREAD_TABLE,
    HF_TRAINER_TABLE,
    SIMULATED_TABLE,
    STEPS40_TABLE,
    TERNGRAD_TABLE,
    DEMO_TABLE,
    QUANTIZER_RUNS_TABLE,
    POWERSGD_RANK_TABLE,
    COMPRESS_SWEEP_TABLE,
    ESTIMATION_TABLE,
    EST_SPEED_TABLE,
    COMPRESS_25M_TABLE,
    COMPRESS_REGISTRY_TABLE,
    COMPRESS_CODES_TABLE,
    RANDOMK_SAMPLING_TABLE,
    VGC_ACCURACY_TABLE,
    VGC_HOOKS_TABLE,
    _ddp_table("2"),
    _ddp_table("4"),
    EXIT_TABLE,
    PADDING_TABLE,
    AUTO_TABLE,
    MEMORY_TABLE,
    MEMORY_COST_TABLE,
    VERDICT_TABLE,
    AUTO_MATRIX_TABLE,
    AUTO_REPEATED_TABLE,
    AUTO_TTA_TABLE,
    AUTO_VGG_CONTROLS_TABLE,
    AUTO_VGG_LONGER_TABLE,
    AUTO_VGG_LONGER_ARMS_TABLE,
    SECOND_CNN_TABLE,
    AUTO_WHOLE_TABLE,
    AUTO_BESIDE_TABLE,
    NANOGPT_TABLE,
)
CLAIMS = (
    *ESTIMATION_CLAIMS, *COMPRESS_CLAIMS, *TRAINING_CLAIMS, *TRAINING_SEEDS_CLAIMS, *VGC_CLAIMS, *VGC_HOOK_CLAIMS, *VGC_STAMP_CLAIMS, *PADDING_CLAIMS, *HOOK_CLAIMS, *HOOK_RADIX_TOPK_CLAIMS, *HOOK_SPREAD_CLAIMS, *QUANTIZER_CLAIMS, *POWERSGD_RANK_CLAIMS, *HOOK_VERDICT_CLAIMS, *BITPACK_CLAIMS, *EST_SPEED_CLAIMS,
    *SCALING_CLAIMS, *PREDICTION_CLAIMS, *STEPS40_CLAIMS, *EXIT_CLAIMS, *VERDICT_CLAIMS, *AUTO_CLAIMS, *MEMORY_CLAIMS, *AUTO_MATRIX_CLAIMS, *AUTO_TTA_CLAIMS, *AUTO_VGG_CONTROLS_CLAIMS, *AUTO_VGG_LONGER_CLAIMS, *SECOND_CNN_CLAIMS, *AUTO_WHOLE_CLAIMS, *AUTO_BESIDE_CLAIMS, *AUTO_REPEATED_CLAIMS, *DEMO_CLAIMS, *COMPRESS_SWEEP_CLAIMS, *NANOGPT_CLAIMS, *MEMORY_SIZE_CLAIMS, *(c for table in TABLES for c in table.claims),
)  # fmt: skip
