"""``auto``'s time to the target on each link, composed from committed curves and step times.

Issue 42's target: on every emulated link and workload, ``auto``'s time to the target
within 1.05x of the best fixed candidate's, and never later than stock DDP's. No run
measures that whole; this composes it, reading only committed results (no training):

* **Step times** per link x workload x arm: ``results/auto/links.json`` (``links.py``: one
  40-step run per arm, seed 0): each fixed candidate's median step, and ``auto``'s choice,
  the step it decided at and its probes' measured times; where ``links-repeated.json``
  (``links.py --repeats``) has the row, its median run per arm instead.
* **Curves**: GPT + AdamW on 2 workers -- the convergence protocol's ``gpt-adamw`` runs
  (``results/convergence/runs/gpt-adamw/<arm>-e0.3-s<seed>/``, 314 steps, 3 seeds);
  VGG + SGD on 4 workers -- ``results/training/runs/<arm>-w4-1gbit/`` (one seed, 200 steps,
  evaluated every 25), checked evaluation for evaluation against the same arm's
  ``-w4-100mbit`` run (the curve does not depend on the link when they agree).
* **Target**: fp32's (``none``'s) final test accuracy minus 0.5 point, or its final
  validation loss x 1.01 (the mean over its seeds), as ``convergence/analyze.py``.

A fixed arm's time to the target is the first evaluation's step at or past the target (no
interpolation between evaluations) times its median step on that link. ``auto``'s is its
measuring steps (``decided_at``; the probes run after the last one's optimizer step) at the
median step of the method they ran (``measured_on``: ``sidco-exp`` under SGD, stock DDP
under AdamW and in runs before that field), plus its probes' one-off cost, plus the chosen
candidate's steps after the switch at that candidate's median step; its curve is the chosen
candidate's (where it kept the method it measured on, that method's bit for bit; a method
switched to after the measuring steps is approximated by its curve from the start). The probes' cost is
estimated as :data:`PROBE_CALLS` times the sum of the measured per-candidate times: each
candidate's route (``"route <name>"``, in ms) or, in the older format of ``links.json``,
its message plus its codec (``"message <name>"`` + ``"codec <name>"``). With several seeds
every time is per seed (the step times are seed 0's for all), and the ratios
``auto`` / best fixed and ``auto`` / ``none`` are paired per seed, with a 95 % t-interval
over the seeds where both reached the target. Usage (repository root; CPU only, seconds)::

    python benchmarks/auto/time_to_target.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance, paths
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convergence"))  # its run readers
sys.path.insert(0, str(Path(__file__).resolve().parent))
import analyze
import provenance
from intervals import bounds
from paths import ROOT

#: Calls per candidate the probes make: one untimed, then ``gradsift.hook.probes.PROBES`` (5) timed.
PROBE_CALLS = 6
LINKS_JSON = ROOT / "results" / "auto" / "links.json"
#: ``links.py --repeats``'s rows (the rows within noise of another arm), where they exist.
REPEATED_JSON = ROOT / "results" / "auto" / "links-repeated.json"
OUT_JSON = ROOT / "results" / "auto" / "time_to_target.json"
GPT_RUNS = ROOT / "results" / "convergence" / "runs" / "gpt-adamw"
VGG_RUNS = ROOT / "results" / "training" / "runs"
GPT_SEEDS = (0, 1, 2)
#: The VGG curves' link, and the link whose runs of the same arm must give the same curve.
VGG_LINK, VGG_OTHER_LINK = "1gbit", "100mbit"
#: Seed 0's VGG curves are the ``VGG_LINK`` runs; the other seeds' (``vgg_seeds.py``, localhost)
#: lie in ``VGG_SEED_RUNS/<arm>-s<seed>/``, where they have been run.
VGG_SEED_RUNS = ROOT / "results" / "auto" / "vgg_seeds"
VGG_SEEDS = (0, 1, 2)
#: More VGG seeds run the same way, not composed: their steps to the composed target are set
#: beside (``targets/vgg/more_seeds``), a check of the composed seeds' ranking.
VGG_MORE_SEEDS = (3, 4)

#: One arm's evaluations per seed: ``{seed: [(step, metric), ...]}``.
Curve = dict[int, list[tuple[int, float]]]


# -- the curves ---------------------------------------------------------------------------------
def read_evals(folder: Path) -> list[dict[str, Any]]:
    """A run folder's evaluations (``evals.jsonl``, gzipped or not)."""
    path = next((p for p in (folder / "evals.jsonl", folder / "evals.jsonl.gz") if p.is_file()), None)
    if path is None:
        raise FileNotFoundError(f"{folder}: no evals.jsonl(.gz)")
    return analyze.read_jsonl(path)


def points(workload: str, evals: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """``(step, the workload's metric)`` per evaluation (``analyze.metric``)."""
    return [(int(e["step"]), float(analyze.metric(workload, e))) for e in evals]


def gpt_curves(
    arms: tuple[str, ...], runs: Path = GPT_RUNS, seeds: tuple[int, ...] = GPT_SEEDS
) -> dict[str, Curve]:
    return {
        arm: {s: points("gpt-adamw", read_evals(runs / f"{arm}-e0.3-s{s}")) for s in seeds} for arm in arms
    }


def vgg_curves(
    arms: tuple[str, ...], runs: Path = VGG_RUNS, seed_runs: Path = VGG_SEED_RUNS
) -> tuple[dict[str, Curve], dict[str, Any]]:
    """The VGG curves -- seed 0 from the ``VGG_LINK`` runs, the other :data:`VGG_SEEDS` from
    ``seed_runs`` where every arm has them -- and, per arm, whether seed 0's ``VGG_OTHER_LINK``
    run of the same arm evaluated the same (step, accuracy, loss) throughout."""
    curves, same = {}, {}
    more = [s for s in VGG_SEEDS[1:] if all((seed_runs / f"{arm}-s{s}").is_dir() for arm in arms)]
    for arm in arms:
        evals = read_evals(runs / f"{arm}-w4-{VGG_LINK}")
        other = read_evals(runs / f"{arm}-w4-{VGG_OTHER_LINK}")
        key = [(e["step"], e["accuracy"], e["loss"]) for e in evals]
        same[arm] = key == [(e["step"], e["accuracy"], e["loss"]) for e in other]
        curves[arm] = {0: points("vgg", evals)}
        curves[arm].update({s: points("vgg", read_evals(seed_runs / f"{arm}-s{s}")) for s in more})
    check = {
        "links": [VGG_LINK, VGG_OTHER_LINK],
        "same_per_arm": same,
        "link_independent": all(same.values()),
    }
    return curves, check


def more_seeds(arms: tuple[str, ...], goal: float, seed_runs: Path = VGG_SEED_RUNS) -> dict[str, Any]:
    """Per VGG arm, the steps to ``goal`` of the :data:`VGG_MORE_SEEDS` that every arm has run."""
    seeds = [s for s in VGG_MORE_SEEDS if all((seed_runs / f"{arm}-s{s}").is_dir() for arm in arms)]
    return {
        "seeds": seeds,
        "steps_to_target": {
            arm: [
                step_to_target("vgg", points("vgg", read_evals(seed_runs / f"{arm}-s{s}")), goal)
                for s in seeds
            ]
            for arm in arms
        },
    }


def target(workload: str, reference: Curve) -> tuple[float, float]:
    """``(fp32's final metric -- the mean over its seeds --, the target)``, as ``analyze.py``."""
    final = statistics.fmean(curve[-1][1] for curve in reference.values())
    if analyze.is_loss_metric(workload):
        return final, final * (1 + analyze.LOSS_MARGIN)
    return final, final - analyze.ACCURACY_MARGIN


def step_to_target(workload: str, curve: list[tuple[int, float]], goal: float) -> int | None:
    """The first evaluation's step at or past ``goal`` (None: never reached)."""
    return next((step for step, value in curve if analyze.reached(workload, value, goal)), None)


# -- the step times and the probes ---------------------------------------------------------------
def probe_ms(measured: dict[str, float]) -> tuple[str, dict[str, float]]:
    """``(format, per-candidate ms)`` of ``auto``'s probes from its ``measured_ms``: the new
    format's ``"route <name>"`` (not ``"route <name> paid"``, what the running method's steps
    paid), or the old one's ``"message <name>"`` plus ``"codec <name>"``."""
    routes = {
        k.removeprefix("route "): v
        for k, v in measured.items()
        if k.startswith("route ") and not k.endswith(" paid")
    }
    if routes:
        return "route", routes
    messages = {k.removeprefix("message "): v for k, v in measured.items() if k.startswith("message ")}
    if not messages:
        raise ValueError(f"auto's measured_ms has neither routes nor messages: {sorted(measured)}")
    return "message+codec", {n: ms + measured.get(f"codec {n}", 0.0) for n, ms in messages.items()}


def probe_seconds(measured: dict[str, float], per_candidate_ms: dict[str, float]) -> float:
    """The probes' one-off cost: the wall time auto measured (``"probing"``, newer runs), or
    the estimate :data:`PROBE_CALLS` calls of each candidate's measured time."""
    if "probing" in measured:
        return measured["probing"] / 1e3
    return PROBE_CALLS * sum(per_candidate_ms.values()) / 1e3


# -- the composition ------------------------------------------------------------------------------
def fixed_time(steps: int | None, step_s: float) -> float | None:
    return None if steps is None else steps * step_s


def auto_time(
    steps: int | None, decided_at: int, measuring_s: float, probe_s: float, chosen_s: float
) -> float | None:
    """``auto``'s time to the evaluation at ``steps`` (on the chosen candidate's curve): the
    first ``decided_at`` steps at the measuring method's step ``measuring_s``, the probes
    after the last of them, then the chosen candidate's steps."""
    if steps is None:
        return None
    measuring = min(steps, decided_at)
    return (
        measuring * measuring_s
        + (probe_s if steps >= decided_at else 0.0)
        + max(steps - decided_at, 0) * chosen_s
    )


def paired(numerators: list[float | None], denominators: list[float | None]) -> dict[str, Any]:
    """Per-seed ratios (None where either did not reach), and their mean and 95 % t-interval
    over the seeds where both did (no interval from one seed)."""
    ratios = [
        None if a is None or b is None else a / b for a, b in zip(numerators, denominators, strict=True)
    ]
    values = [r for r in ratios if r is not None]
    summary: dict[str, Any] = {"per_seed": ratios, "n": len(values), "mean": None, "low": None, "high": None}
    if values:
        mean, low, high = bounds(values)
        summary.update(
            mean=mean, low=low if len(values) > 1 else None, high=high if len(values) > 1 else None
        )
    return summary


def mean_reached(values: list[float | None]) -> float | None:
    """The mean over the seeds that reached the target (None: none did)."""
    reached = [v for v in values if v is not None]
    return statistics.fmean(reached) if reached else None


def compose(
    link: str, workload: str, runs: dict[str, dict[str, Any]], curves: dict[str, Curve], goal: float
) -> dict[str, Any]:
    """One link x workload: every fixed arm's and ``auto``'s time to ``goal`` per seed, the
    best fixed arm per seed, and the paired ratios."""
    fixed = [arm for arm in runs if arm != "auto" and arm in curves]
    seeds = sorted(curves["none"])
    step_s = {arm: runs[arm]["step_time_median_s"] for arm in runs}
    steps = {arm: [step_to_target(workload, curves[arm][s], goal) for s in seeds] for arm in fixed}
    times = {arm: [fixed_time(n, step_s[arm]) for n in steps[arm]] for arm in fixed}

    decision = runs["auto"]["auto"]
    choice, decided_at = decision["choice"], int(decision["decided_at"])
    if choice not in curves:
        raise ValueError(f"{link} {workload}: auto chose {choice!r}, which has no curve")
    probe_format, per_candidate = probe_ms(decision["measured_ms"])
    probe_s = probe_seconds(decision["measured_ms"], per_candidate)
    if "probing" in decision["measured_ms"]:
        probe_format += ", probes' wall time measured"
    auto_steps = [step_to_target(workload, curves[choice][s], goal) for s in seeds]
    measured_on = decision.get("measured_on", "none")
    auto_times = [auto_time(n, decided_at, step_s[measured_on], probe_s, step_s[choice]) for n in auto_steps]

    best_names, best_steps, best_times = [], [], []
    for i in range(len(seeds)):
        reached = {arm: times[arm][i] for arm in fixed if times[arm][i] is not None}
        name = min(reached, key=lambda arm: reached[arm]) if reached else None
        best_names.append(name)
        best_steps.append(None if name is None else steps[name][i])
        best_times.append(None if name is None else reached[name])
    return {
        "link": link,
        "workload": workload,
        "seeds": seeds,
        "step_time_median_s": step_s,
        "fixed": {
            arm: {
                "steps_to_target": steps[arm],
                "time_to_target_s": times[arm],
                "mean_s": mean_reached(times[arm]),
                "reached": sum(t is not None for t in times[arm]),
            }
            for arm in fixed
        },
        "auto": {
            "choice": choice,
            "decided_at": decided_at,
            "measured_on": measured_on,
            "probe_format": probe_format,
            "probe_ms": per_candidate,
            "probe_s": probe_s,
            "steps_to_target": auto_steps,
            "time_to_target_s": auto_times,
            "mean_s": mean_reached(auto_times),
            "reached": sum(t is not None for t in auto_times),
            # what the measuring steps and the probes cost over running the choice from the start
            "one_off_s": [
                None if a is None or n is None else a - n * step_s[choice]
                for a, n in zip(auto_times, auto_steps, strict=True)
            ],
        },
        "best_fixed": {
            "per_seed": best_names,
            "names": sorted({n for n in best_names if n is not None}),
            "steps_to_target": best_steps,
            "time_to_target_s": best_times,
            "mean_s": mean_reached(best_times),
            "reached": sum(t is not None for t in best_times),
        },
        "auto_over_best_fixed": paired(auto_times, best_times),
        "auto_over_none": paired(auto_times, times["none"]),
    }


#: Issue 42's margin: auto's time to the target within this factor of the best fixed candidate's.
MARGIN = 1.05


def verdict(row: dict[str, Any]) -> dict[str, bool | None]:
    """Issue 42's two conditions on the mean ratios (None where no seed reached the target)."""
    best, none = row["auto_over_best_fixed"]["mean"], row["auto_over_none"]["mean"]
    return {
        "within_margin_of_best_fixed": None if best is None else best <= MARGIN,
        "not_later_than_none": None if none is None else none <= 1.0,
    }


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shown(path: Path) -> str:
    """``path`` relative to the repository root where it is inside it."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def analyze_links(
    links: dict[str, Any],
    curves_of: Callable[[str, tuple[str, ...]], dict[str, Curve]],
    repeated: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Every row of ``links.json`` composed with the curves ``curves_of(workload, arms)``; a
    row of ``repeated`` (``links.py --repeats``: each arm's median run) replaces the same link
    and workload's single run."""
    again = {(e["summary"]["link"], e["summary"]["workload"]): e for e in (repeated or {}).get("rows", [])}
    rows = []
    for single in links["rows"]:
        key = (single["summary"]["link"], single["summary"]["workload"])
        entry = again.get(key, single)
        arms = tuple(arm for arm in entry["runs"] if arm != "auto")
        curves = curves_of(key[1], arms)
        _, goal = target(key[1], curves["none"])
        row = compose(*key, entry["runs"], curves, goal)
        rows.append({**row, **verdict(row), "step_times": "repeated" if key in again else "single"})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--links", type=Path, default=LINKS_JSON, help="links.py's result (default: %(default)s)"
    )
    parser.add_argument(
        "--repeated", type=Path, default=REPEATED_JSON,
        help="links.py --repeats's rows, replacing the same rows of --links where the file exists "
        "(default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=OUT_JSON, help="where to write (default: %(default)s)")
    args = parser.parse_args(argv)
    stamp = provenance.start(seeds=list(GPT_SEEDS))
    links = json.loads(args.links.read_text())
    repeated = json.loads(args.repeated.read_text()) if args.repeated.exists() else None
    vgg_check: dict[str, Any] = {}
    cache: dict[str, dict[str, Curve]] = {}

    def curves_of(workload: str, arms: tuple[str, ...]) -> dict[str, Curve]:
        if workload not in cache:
            if workload == "vgg":
                cache[workload], check = vgg_curves(arms)
                vgg_check.update(check)
            elif workload == "gpt-adamw":
                cache[workload] = gpt_curves(arms)
            else:
                raise ValueError(f"no curves for workload {workload!r}")
        return cache[workload]

    rows = analyze_links(links, curves_of, repeated)
    targets = {}
    for workload, curves in cache.items():
        final, goal = target(workload, curves["none"])
        targets[workload] = {
            "metric": analyze.metric_name(workload), "fp32_final": final, "target": goal,
            "seeds": sorted(curves["none"]),
            "steps_to_target": {arm: [step_to_target(workload, c[s], goal) for s in sorted(c)]
                                for arm, c in curves.items()},
            "evals": {arm: {str(s): c[s] for s in sorted(c)} for arm, c in curves.items()},
        }  # fmt: skip
    if "vgg" in targets:
        targets["vgg"]["more_seeds"] = more_seeds(tuple(cache["vgg"]), targets["vgg"]["target"])
    stamp_of_links = links.get("provenance", {})
    report = {
        "inputs": {
            "links": {
                "path": shown(args.links),
                "sha256": digest(args.links),
                "commit": stamp_of_links.get("commit"),
                "started": stamp_of_links.get("started"),
                "probe_format": sorted({r["auto"]["probe_format"] for r in rows}),
            },
            "repeated": None
            if repeated is None
            else {
                "path": shown(args.repeated),
                "sha256": digest(args.repeated),
                "commit": repeated["provenance"].get("commit"),
                "repeats": repeated["repeats"],
                "rows": [f"{e['summary']['link']} {e['summary']['workload']}" for e in repeated["rows"]],
            },
            "vgg_curves": {
                "runs": f"results/training/runs/<arm>-w4-{VGG_LINK} (seed 0), {shown(VGG_SEED_RUNS)}/<arm>-s<seed>",
                **vgg_check,
            },
            "gpt_curves": {"runs": "results/convergence/runs/gpt-adamw/<arm>-e0.3-s<seed>"},
        },
        "rules": {
            "fixed": "steps to the first evaluation at or past the target x the arm's median step on the link",
            "auto": "decided_at steps x the measuring method's (measured_on) median step + the probes + the "
            "chosen candidate's steps after decided_at x its median step; the chosen candidate's curve",
            "probe_calls_per_candidate": PROBE_CALLS,
            "margin": MARGIN,
            "probes": f"{PROBE_CALLS} x the sum over candidates of the route time (or message + codec)",
        },
        "targets": targets,
        "rows": rows,
        "provenance": stamp.finish(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    for row in rows:
        print(json.dumps({k: row[k] for k in ("link", "workload")} | {
            "best": row["best_fixed"]["names"], "best_s": row["best_fixed"]["mean_s"], "choice": row["auto"]["choice"],
            "auto_s": row["auto"]["mean_s"], "probe_s": round(row["auto"]["probe_s"], 3),
            "auto/best": row["auto_over_best_fixed"]["mean"], "auto/none": row["auto_over_none"]["mean"]}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
