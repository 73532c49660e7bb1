"""Issue 44's controls: the runs that tell the optimizer's effect from the compression's.

The 1-bit arm (``onebit-adam``: the hook's frozen-variance AdamW with ``efsignsgd``, the
trainer's 10 % dense warm-up) ends *below* fp32 DDP at 3,000 steps. Two explanations: a
different optimizer (the second moment frozen at the end of the warm-up; the gradient
clipping applied to the exchanged first moment, which the hook hands DDP), or the
compression. The controls here separate them, on the ``gpt-adamw`` workload (2 workers):

- ``fp32-lr1.5e-3``, ``fp32-lr6e-3``: stock DDP at half and twice the protocol's lr 3e-3 (the
  3-point learning-rate screen; 3e-3 itself is the campaign's ``none``);
- ``dense-fv``: the hook's frozen-variance method with a dense exchange -- ``topk`` at ratio 1
  without momentum-factor masking, which ``tests/hook/test_adam.py`` checks equal to the
  method written out -- so everything of the 1-bit arm but the compression;
- the existing runs of the protocol (``results/convergence/runs/``) for fp32 at 3e-3, bf16, one
  worker alone and the 1-bit arm; ``repro`` reruns two of them (seed 0) on this commit, so
  that pairing new runs with them rests on a measured bit-for-bit (or not) reproduction.

Order: the 314-step screen first (every arm, seed by seed), the reproduction checks, then the
3,000-step dense frozen-variance arm (the control the issue's claim is about), then, at 3,000
steps, the new lr with the lower 314-step mean (``--extended``: the other one too). Each run is ``gradsift train`` in its own process (``run.py``'s ``execute``:
provenance stamp with the load before and after, steps gzipped); a run whose summary.json
exists is skipped, so rerunning the command resumes::

    PYTHONPATH=$PWD/src nohup nice -n 19 python benchmarks/convergence/campaign44.py run &
    python benchmarks/convergence/campaign44.py status

Runs go to ``results/convergence/issue44/runs/<workload>/<arm>-e<epochs>-s<seed>/`` of the
checkout that runs this script (``--root`` another); timings are discarded (accuracy and
bytes only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from protocol import METHODS, RESULTS, WORKLOADS, Method

ISSUE44 = RESULTS / "issue44"

#: The new arms (the others are the protocol's METHODS, by the same name).
ARMS = {
    "fp32-lr1.5e-3": Method("none", flags=("--lr", "0.0015"), setting="fp32 allreduce (stock DDP), lr 1.5e-3"),
    "fp32-lr6e-3": Method("none", flags=("--lr", "0.006"), setting="fp32 allreduce (stock DDP), lr 6e-3"),
    "dense-fv": Method("topk", {"ratio": 1.0, "momentum_masking": False},
                       setting="the hook's frozen-variance AdamW, dense exchange (topk ratio 1, no momentum "
                               "masking): the 1-bit arm's optimizer without its compression"),
    "fp32-repro": Method("none", setting="stock DDP, fp32, lr 3e-3: the protocol's none again, on this commit"),
    "onebit-adam-w50": Method("efsignsgd", {"warmup_steps": 50},
                              setting="the 1-bit arm with a 50-step fp32 warm-up: the control of a short freeze"),
    "onebit-adam-q4w50": Method("efsignsgd", {"warmup_steps": 50, "warmup_compressor": "blockquant"},
                                setting="the 1-bit arm with a 50-step warm-up in 4-bit block codes with error "
                                        "feedback (warmup_compressor='blockquant')"),
    "onebit-adam-q4w100": Method("efsignsgd", {"warmup_steps": 100, "warmup_compressor": "blockquant"},
                                 setting="the 1-bit arm with a 100-step warm-up in 4-bit block codes with error "
                                         "feedback: the longest coded warm-up that keeps >= 30x at 6,000 steps"),
    **{
        f"lion-lr{lr}": Method("none", flags=("--optimizer", "lion", "--lr", lr),
                               setting=f"gradsift.DistributedLion (sign updates majority-voted, 1 bit per parameter "
                                       f"per step, no warm-up), lr {lr}, weight decay 1.0 (the trainer's)")
        for lr in ("1e-4", "3e-4", "1e-3")
    },
    **{
        f"lion-lr{lr}-wd0.1": Method("none", flags=("--optimizer", "lion", "--lr", lr, "--weight-decay", "0.1"),
                                     setting=f"gradsift.DistributedLion, lr {lr}, weight decay 0.1 (AdamW's)")
        for lr in ("3e-4", "1e-3")
    },
    "fp32-repro-w4": Method("none", setting="stock DDP, fp32, lr 3e-3, 4 workers: the protocol's none again, on this commit"),
    "onebit-adam-q4w150-2s": Method("efsignsgd", {"warmup_steps": 150, "warmup_compressor": "blockquant",
                                                  "exchange": "two-stage"},
                                    setting="the coded warm-up's 1-bit arm through the two-stage compressed allreduce "
                                            "(1-bit Adam's: all-to-all of coded chunks, a server residual per chunk, "
                                            "allgather); 150 warm-up steps in 4-bit codes, the most that keep >= 26x "
                                            "received at 4 workers"),
    "onebit-adam-q4w25-r280": Method("efsignsgd", {"warmup_steps": 25, "warmup_compressor": "blockquant",
                                                   "variance_refresh": [[280, 20]]},
                                     setting="the 1-bit arm with a 25-step warm-up in 4-bit codes whose frozen "
                                             "second moment is estimated again from the 4-bit codes of steps "
                                             "280-299 (variance_refresh): the 300-step freeze's variance at the "
                                             "byte budget of a 50-step coded warm-up"),
    "onebit-adam-q4w25-r280-2s": Method("efsignsgd", {"warmup_steps": 25, "warmup_compressor": "blockquant",
                                                      "variance_refresh": [[280, 20]], "exchange": "two-stage"},
                                        setting="the variance refresh's arm through the two-stage exchange (4 "
                                                "workers: about 30x received)"),
    **{  # zero-one-q4w300-l500x2 is the protocol's (its whole emulated runs are run.py validation's)
        f"zero-one-q4w{warmup}-l{every}x{longest}{tail}": Method(
            "efsignsgd", {"warmup_steps": warmup, "warmup_compressor": "blockquant", "adam": "zero-one",
                          "local_steps": [every, longest], **extra},
            setting=f"0/1 Adam's local steps (adam='zero-one'): a {warmup}-step warm-up in 4-bit codes, then the "
                    f"1-bit message once per interval, the interval doubling every {every} compressed steps "
                    f"up to {longest}{where}")
        for every, longest in ((500, 2), (250, 4))
        for warmup, tail, extra, where in (
            (300, "", {}, ""),
            (300, "-2s", {"exchange": "two-stage"}, "; the two-stage exchange (4 workers)"),
            (600, "", {}, " (6,000 steps: the trainer's 10 % warm-up length, coded)"),
        )
        if (warmup, tail, every, longest) != (300, "", 500, 2)
    },
}  # fmt: skip

SEEDS = (0, 1, 2)
#: Issue 44's rule, 5 seeds where an interval straddles a target: seeds 3 and 4 of fp32 and of
#: the 50-step coded warm-up (+1.4 % [+0.2, +2.6] over seeds 0-2 straddles +1 %) at 3,000 steps.
EXTRA_SEEDS = (3, 4)
FIVE_ARMS = ("none", "onebit-adam-q4w50")
SCREEN, LONG, LONGER = "gpt-adamw", "gpt-adamw-3k", "gpt-adamw-6k"
#: At 6,000 steps, seed by seed: fp32, 4-bit averaging every 10 steps (the >= 30x mode), the
#: 1-bit Adam anchor, one worker alone -- whether the 3,000-step gaps keep shrinking.
LONGER_ARMS = ("none", "qavg-blockquant4-h10", "onebit-adam", "alone")
LR_ARMS = ("fp32-lr1.5e-3", "fp32-lr6e-3")
#: The coded warm-up (issue 44, item 3): the 1-bit arm whose 50-step warm-up travels in 4-bit
#: codes (>= 30x fewer bytes at 3,000 steps), beside the same 50 steps in fp32 (the short
#: freeze's own effect), paired with the 3,000-step fp32 runs of the same seeds.
CODED_ARMS = ("onebit-adam-q4w50", "onebit-adam-w50")
#: Distributed Lion's learning-rate screen (314 steps, seed 0): weight decay the trainer's 1.0, then AdamW's 0.1.
LION_ARMS = ("lion-lr3e-4", "lion-lr1e-3", "lion-lr1e-4", "lion-lr3e-4-wd0.1", "lion-lr1e-3-wd0.1")
#: The same at 4 workers, where the allgather's received bytes grow with W: through the
#: two-stage exchange, paired with the protocol's 4-worker, 3,000-step fp32 runs.
WIDE, WIDE_SCREEN = "gpt-adamw-w4-3k", "gpt-adamw-w4"
#: The variance refresh (issue 44): the early freeze's cost is the early variance, so the
#: 1-bit arm freezes at step 25 and estimates the variance again over steps 280-299, paired
#: with the 3,000-step fp32 runs and comparable with the 50-step coded warm-up at the same bytes.
REFRESH_ARM = "onebit-adam-q4w25-r280"
#: 0/1 Adam's local steps (issue 44, item 3): syncing the 1-bit message once per interval frees
#: the byte budget for a 300-step coded warm-up (the freeze the 1 % target needs) at >= 30x.
ZERO_ONE_ARMS = ("zero-one-q4w300-l500x2", "zero-one-q4w300-l250x4")
#: Every 0/1 Adam arm: these two and their 4-worker and 6,000-step variants.
ZERO_ONE = tuple(dict.fromkeys([*ZERO_ONE_ARMS, *(arm for arm in ARMS if arm.startswith("zero-one-"))]))


def method(name: str) -> Method:
    return ARMS[name] if name in ARMS else METHODS[name]


@dataclass(frozen=True)
class Run:
    """One planned run of this campaign (same flags as ``protocol.Run``; its own folder)."""

    workload: str
    method: str
    seed: int
    root: Path = ISSUE44

    @property
    def epochs(self) -> float:
        return WORKLOADS[self.workload].epochs

    @property
    def name(self) -> str:
        return f"{self.method}-e{self.epochs:g}-s{self.seed}"

    @property
    def directory(self) -> Path:
        return self.root / "runs" / self.workload / self.name

    def arguments(self) -> list[str]:
        workload = WORKLOADS[self.workload]
        return [*workload.train_arguments(self.epochs), *method(self.method).train_arguments(),
                "--seed", str(self.seed)]  # fmt: skip


def final_loss(run: Run) -> float | None:
    path = run.directory / "summary.json"
    return json.loads(path.read_text())["final_test_loss"] if path.is_file() else None


def screen_mean(arm: str, root: Path) -> float:
    """The arm's mean final validation loss over the finished seeds of the 314-step screen."""
    losses = [loss for seed in SEEDS if (loss := final_loss(Run(SCREEN, arm, seed, root))) is not None]
    return sum(losses) / len(losses) if losses else float("inf")


def plan(
    root: Path = ISSUE44,
    extended: bool = False,
    longer: bool = False,
    coded: bool = False,
    wide: bool = False,
    lion: bool = False,
    refresh: bool = False,
    five: bool = False,
    zero_one: bool = False,
) -> list[Run]:
    """The campaign in priority order (recomputed after every run). At 3,000 steps: the dense
    frozen-variance arm (3 seeds), then the lr of the screen's two new ones with the lower
    314-step mean (3 seeds); ``extended`` adds the other lr (3 seeds), beyond the ~75 min
    this machine gave the campaign; ``longer`` runs only the 6,000-step phase (:data:`LONGER_ARMS`),
    ``coded`` only the coded warm-up's (:data:`CODED_ARMS`: fp32's reproduction at 314 steps on
    this commit, seed 0, then seed by seed at 3,000 steps); ``wide`` its 4-worker phase (the
    two-stage arm, after fp32's 4-worker reproduction); ``lion`` Distributed Lion's lr screen; ``longer`` with ``coded`` the coded
    warm-up's arm at 6,000 steps (100 warm-up steps there: the most that keep >= 30x);
    ``refresh`` only the variance refresh's arm (:data:`REFRESH_ARM`, 3,000 steps, seed by seed;
    with ``longer`` at 6,000 steps, with ``wide`` at 4 workers through the two-stage exchange);
    ``five`` seeds 3 and 4 of :data:`FIVE_ARMS` at 3,000 steps; ``zero_one`` :data:`ZERO_ONE_ARMS`
    at 3,000 steps (seed 0), then the better of them: seeds 1 and 2, 4 workers through the
    two-stage exchange, 6,000 steps with a 600-step coded warm-up (the trainer's 10 %), seeds 3
    and 4 of fp32 and of the 4-worker arm (its 3-seed interval straddles +1 %); then seed 3 of
    fp32 and of the 6,000-step arm (its interval straddles +1 % too), the dense frozen-variance
    control at 4 workers (seed 0), their seed 4; the controls the 6,000-step table lacks (the
    dense frozen-variance arm and bf16, seeds 0-2), the 4-worker control's seeds 1 and 2; then
    the other's seeds 1 and 2."""
    if zero_one:
        runs = [Run(LONG, arm, 0, root) for arm in ZERO_ONE_ARMS]
        better, other = sorted(
            ZERO_ONE_ARMS, key=lambda arm: final_loss(Run(LONG, arm, 0, root)) or float("inf")
        )
        longer = better.replace("q4w300", "q4w600")
        runs += [Run(LONG, better, seed, root) for seed in SEEDS[1:]]
        runs += [Run(WIDE, f"{better}-2s", seed, root) for seed in SEEDS]
        runs += [Run(LONGER, longer, seed, root) for seed in SEEDS]
        runs += [Run(WIDE, arm, seed, root) for seed in EXTRA_SEEDS for arm in ("none", f"{better}-2s")]
        seed3, seed4 = ([Run(LONGER, arm, seed, root) for arm in ("none", longer)] for seed in EXTRA_SEEDS)
        runs += [*seed3, Run(WIDE, "dense-fv", 0, root), *seed4]
        runs += [Run(LONGER, arm, seed, root) for seed in SEEDS for arm in ("dense-fv", "bf16")]
        runs += [Run(WIDE, "dense-fv", seed, root) for seed in SEEDS[1:]]
        return runs + [Run(LONG, other, seed, root) for seed in SEEDS[1:]]
    if five:
        return [Run(LONG, arm, seed, root) for seed in EXTRA_SEEDS for arm in FIVE_ARMS]
    if refresh and longer:
        return [Run(LONGER, REFRESH_ARM, seed, root) for seed in SEEDS]
    if refresh and wide:
        return [Run(WIDE, f"{REFRESH_ARM}-2s", seed, root) for seed in SEEDS]
    if refresh:
        return [Run(LONG, REFRESH_ARM, seed, root) for seed in SEEDS]
    if lion:
        return [Run(SCREEN, arm, 0, root) for arm in LION_ARMS]
    if longer and coded:
        return [Run(LONGER, "onebit-adam-q4w100", seed, root) for seed in SEEDS]
    if wide:
        return [Run(WIDE_SCREEN, "fp32-repro-w4", 0, root)] + [
            Run(WIDE, "onebit-adam-q4w150-2s", seed, root) for seed in SEEDS
        ]
    if coded:
        return [Run(SCREEN, "fp32-repro", 0, root)] + [
            Run(LONG, arm, seed, root) for seed in SEEDS for arm in CODED_ARMS
        ]
    if longer:
        return [Run(LONGER, arm, seed, root) for seed in SEEDS for arm in LONGER_ARMS]
    runs = [Run(SCREEN, arm, seed, root) for seed in SEEDS for arm in ("dense-fv", *LR_ARMS)]
    runs += [Run(SCREEN, "none", 0, root), Run(SCREEN, "onebit-adam", 0, root)]  # the reproduction checks
    runs += [Run(LONG, "dense-fv", seed, root) for seed in SEEDS]
    better, *others = sorted(LR_ARMS, key=lambda arm: screen_mean(arm, root))
    runs += [Run(LONG, better, seed, root) for seed in SEEDS]
    if extended:
        runs += [Run(LONG, arm, seed, root) for arm in others for seed in SEEDS]
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("action", choices=("run", "status"))
    parser.add_argument("--root", type=Path, default=ISSUE44, help="where runs/ goes (default: %(default)s)")
    parser.add_argument("--extended", action="store_true", help="also the other lr at 3,000 steps")
    parser.add_argument(
        "--longer",
        action="store_true",
        help="only the 6,000-step phase (LONGER_ARMS; with --coded, the coded warm-up's arm)",
    )
    parser.add_argument("--coded", action="store_true", help="only the coded warm-up's phase (CODED_ARMS)")
    parser.add_argument(
        "--wide", action="store_true", help="only the coded warm-up's 4-worker phase (two-stage)"
    )
    parser.add_argument(
        "--lion", action="store_true", help="only Distributed Lion's lr screen (314 steps, seed 0)"
    )
    parser.add_argument(
        "--refresh", action="store_true", help="only the variance refresh's arm (3,000 steps)"
    )
    parser.add_argument("--five", action="store_true", help="seeds 3 and 4 of FIVE_ARMS (3,000 steps)")
    parser.add_argument(
        "--zero-one", action="store_true", help="0/1 Adam's local steps (ZERO_ONE_ARMS, 3,000 steps)"
    )
    args = parser.parse_args()
    from run import execute, finished  # run.py's machinery: provenance, gzip, skip-if-done

    phases = {name: value for name, value in vars(args).items() if name not in ("action", "root")}

    def planned() -> list[Run]:
        return plan(args.root, **phases)

    if args.action == "status":
        for run in planned():
            print(f"{'done' if finished(run) else 'todo'}  {run.directory.relative_to(args.root)}")
        return 0
    failed: set[Run] = set()
    while True:
        todo = [r for r in planned() if not finished(r) and r not in failed]
        if not todo:
            break
        if not execute(todo[0]):
            failed.add(todo[0])
    print(
        f"[{time.strftime('%H:%M:%S')}] campaign44 over; failed: {sorted(str(r.directory) for r in failed)}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
