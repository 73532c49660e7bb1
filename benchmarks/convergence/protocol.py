"""The convergence protocol: workloads, methods at their papers' settings, and the run plan.

Every run is one ``gradsift train`` command (4 workers -- 2 for ``gpt-adamw`` --, localhost
gloo) whose directory name says what it is:
``results/convergence/runs/<workload>/<method>-e<epochs>-s<seed>/``. The plan is data
only; ``run.py`` executes it and ``analyze.py`` reads the results. The README explains
each choice; docs/decisions.md records how the epochs were decided.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: where results go
from paths import results_dir

RESULTS = results_dir(__file__)
RUNS = RESULTS / "runs"
WORKERS = 4
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


@dataclass(frozen=True)
class Workload:
    """One model + data + optimizer setting; ``epochs`` is the protocol length (decided
    from fp32's own curve, see README), ``study_epochs`` the fp32 lengths that decided it.

    Learning rate: linear warm-up over ``warmup_epochs``, then cosine to 0 at the end.
    ``optimizer``: the trainer's ``--optimizer`` (None: its default for the model);
    ``clip_grad_norm``: its ``--clip-grad-norm`` (0: no clipping).
    """

    model: str
    batch_size: int
    lr: float
    epochs: float
    study_epochs: tuple[float, ...]
    evals_per_epoch: int
    steps_per_epoch: int
    warmup_epochs: float = 0.1
    data_dir: str | None = FASHION_MNIST
    seeds: tuple[int, ...] = (0, 1, 2)
    workers: int = WORKERS
    optimizer: str | None = None
    clip_grad_norm: float = 0.0

    def steps(self, epochs: float) -> int:
        return round(epochs * self.steps_per_epoch)

    def train_arguments(self, epochs: float, steps: int | None = None) -> list[str]:
        """The ``gradsift train`` flags of a run of ``epochs`` (method flags excluded);
        ``steps`` cuts it short (timing runs: same schedule, fewer steps, no evaluation
        until the end)."""
        eval_every = max(1, self.steps_per_epoch // self.evals_per_epoch) if steps is None else 0
        arguments = [
            "--model", self.model, "--workers", str(self.workers), "--batch-size", str(self.batch_size),
            "--lr", str(self.lr), "--lr-schedule", "cosine",
            "--lr-warmup-steps", str(round(self.warmup_epochs * self.steps_per_epoch)),
            "--steps", str(self.steps(epochs) if steps is None else steps), "--eval-every", str(eval_every),
        ]  # fmt: skip
        arguments += ["--optimizer", self.optimizer] if self.optimizer else []
        arguments += ["--clip-grad-norm", str(self.clip_grad_norm)] if self.clip_grad_norm else []
        return arguments + (["--data-dir", self.data_dir] if self.data_dir else [])


#: steps_per_epoch = ceil(ceil(examples / workers) / batch): 60 000 images; 33 475 text windows.
#: ``gpt`` is the protocol's SGD language model; ``gpt-adamw`` the same model with AdamW (betas
#: 0.9/0.99, decoupled decay 0.1: the trainer's defaults for it; the gradients' norm clipped
#: to 1, as GPT recipes do) on 2 workers for 0.3 epoch
#: (314 steps, a CPU budget of ~3 min per run on 2 cores): the AdamW issue's campaign;
#: ``gpt-adamw-w4`` the same 314 steps on 4 workers (0.6 epoch); ``gpt-adamw-1k`` gpt-adamw
#: at 1,000 steps (0.955 epoch, the cosine rescaled): how the gaps move with run length;
#: ``gpt-adamw-3k`` the same at 3,000 steps (2.865 epochs, 4 evaluations per epoch);
#: ``gpt-adamw-w4-1k`` 1,000 steps on 4 workers (1.909 epochs): the gaps' slope at 4 workers;
#: ``gpt-adamw-w4-3k`` 3,000 steps on 4 workers (5.725 epochs, 2 evaluations per epoch);
#: ``gpt-adamw-6k`` gpt-adamw at 6,000 steps (5.731 epochs, 2 evaluations per epoch): whether the
#: gaps keep shrinking with length (issue 44).
WORKLOADS = {
    "vgg": Workload("vgg", 32, 0.05, epochs=4, study_epochs=(2, 4, 8), evals_per_epoch=4, steps_per_epoch=469),
    "resnet20": Workload("resnet20", 32, 0.05, epochs=4, study_epochs=(2, 4), evals_per_epoch=4,
                         steps_per_epoch=469),
    "lstm": Workload("lstm", 32, 0.2, epochs=8, study_epochs=(2, 4, 8), evals_per_epoch=4, steps_per_epoch=469),
    "gpt": Workload("gpt", 16, 0.1, epochs=1, study_epochs=(0.5, 1, 2), evals_per_epoch=8, steps_per_epoch=524,
                    data_dir=None, optimizer="sgd"),
    "gpt-adamw": Workload("gpt", 16, 3e-3, epochs=0.3, study_epochs=(), evals_per_epoch=10, steps_per_epoch=1047,
                          warmup_epochs=0.02, data_dir=None, workers=2, optimizer="adamw",
                          clip_grad_norm=1.0),
    "gpt-adamw-w4": Workload("gpt", 16, 3e-3, epochs=0.6, study_epochs=(), evals_per_epoch=5, steps_per_epoch=524,
                             warmup_epochs=0.04, data_dir=None, workers=4, optimizer="adamw", clip_grad_norm=1.0),
    "gpt-adamw-1k": Workload("gpt", 16, 3e-3, epochs=0.955, study_epochs=(), evals_per_epoch=10,
                             steps_per_epoch=1047, warmup_epochs=0.02, data_dir=None, workers=2, optimizer="adamw",
                             clip_grad_norm=1.0),
    "gpt-adamw-3k": Workload("gpt", 16, 3e-3, epochs=2.865, study_epochs=(), evals_per_epoch=4,
                             steps_per_epoch=1047, warmup_epochs=0.02, data_dir=None, workers=2, optimizer="adamw",
                             clip_grad_norm=1.0),
    "gpt-adamw-6k": Workload("gpt", 16, 3e-3, epochs=5.731, study_epochs=(), evals_per_epoch=2,
                             steps_per_epoch=1047, warmup_epochs=0.02, data_dir=None, workers=2, optimizer="adamw",
                             clip_grad_norm=1.0),
    "gpt-adamw-w4-1k": Workload("gpt", 16, 3e-3, epochs=1.909, study_epochs=(), evals_per_epoch=5,
                                steps_per_epoch=524, warmup_epochs=0.04, data_dir=None, workers=4,
                                optimizer="adamw", clip_grad_norm=1.0),
    "gpt-adamw-w4-3k": Workload("gpt", 16, 3e-3, epochs=5.725, study_epochs=(), evals_per_epoch=2,
                                steps_per_epoch=524, warmup_epochs=0.04, data_dir=None, workers=4,
                                optimizer="adamw", clip_grad_norm=1.0),
}  # fmt: skip


@dataclass(frozen=True)
class Method:
    """A compressor at the setting its paper recommends; ``setting`` says which and why."""

    compressor: str
    options: dict[str, Any] = field(default_factory=dict)
    setting: str = ""
    flags: tuple[str, ...] = ()  # other ``gradsift train`` flags (--no-recipe, --sync-every H)

    @property
    def error_feedback(self) -> bool:
        """Whether the method runs with error feedback (and so with DGC's recipe)."""
        from gradsift.compressors.registry import compressor_class

        return compressor_class(self.compressor).error_feedback

    def train_arguments(self) -> list[str]:
        import json

        arguments = ["--compressor", self.compressor]
        for key, value in self.options.items():
            arguments += ["--option", f"{key}={json.dumps(value)}"]
        return arguments + list(self.flags)


METHODS = {
    "none": Method("none", setting="fp32 allreduce (stock DDP)"),
    "bf16": Method("bf16", setting="bf16 cast, allreduce, cast back"),
    "qsgd": Method("qsgd", {"levels": 15, "bucket_size": 512},
                   setting="16 magnitude levels (4 bits) + sign, buckets of 512 (the paper's 4-bit QSGD)"),
    "terngrad": Method("terngrad", {"granularity": "layer"},
                       setting="per-layer scale max|g|, 2.5-sigma clipping (the paper's c = 2.5)"),
    "vgc": Method("vgc", {"alpha": 1.0, "zeta": 0.999}, setting="alpha 1, zeta 0.999 (the paper's main setting)"),
    "vgc-a2": Method("vgc", {"alpha": 2.0, "zeta": 0.999}, setting="alpha 2, zeta 0.999 (the paper's sparser one)"),
    "powersgd": Method("powersgd", {"rank": 2, "start_iter": 2, "warm_start": True},
                       setting="rank 2, warm start, error feedback, compressed from step 2 (the paper)"),
    "sidco-exp-0.01": Method("sidco-exp", {"ratio": 0.01}, setting="ratio 0.01, adaptive multi-stage fit"),
    "topk-0.01": Method("topk", {"ratio": 0.01}, setting="ratio 0.01"),
    "sidco-exp-0.001": Method("sidco-exp", {"ratio": 0.001}, setting="ratio 0.001"),
    "sidco-gpareto-0.01": Method("sidco-gpareto", {"ratio": 0.01}, setting="ratio 0.01"),
    "sidco-gpareto-0.001": Method("sidco-gpareto", {"ratio": 0.001}, setting="ratio 0.001"),
    "sidco-gamma-0.01": Method("sidco-gamma", {"ratio": 0.01}, setting="ratio 0.01"),
    "sidco-gamma-0.001": Method("sidco-gamma", {"ratio": 0.001}, setting="ratio 0.001"),
    "dgc": Method("dgc", {"ratio": 0.001}, setting="ratio 0.001 (99.9% sparsity, the paper's setting)"),
    "efsignsgd": Method("efsignsgd", setting="scaled sign ||p||_1/d with error feedback"),
    "topk-0.01-no-recipe": Method("topk", {"ratio": 0.01}, flags=("--no-recipe",),
                                  setting="ratio 0.01, error feedback only: the optimizer keeps its moments"),
    "topk-0.01-adam-update": Method("topk", {"ratio": 0.01, "adam": "update"},
                                    setting="ratio 0.01, each worker's own Adam update sent (adam='update')"),
    "sidco-exp-0.01-fit": Method("sidco-exp", {"ratio": 0.01, "exact_below": 0},
                                 setting="ratio 0.01, the fitted threshold on every bucket (no exact path)"),
    "diloco-avg-h10": Method("none", {"outer_lr": 1.0, "outer_momentum": 0.0}, flags=("--sync-every", "10"),
                             setting="parameters averaged every 10 steps (outer lr 1, no momentum)"),
    "diloco-h10": Method("none", {"outer_lr": 0.7, "outer_momentum": 0.9}, flags=("--sync-every", "10"),
                         setting="DiLoCo, H 10, fp32 pseudo-gradient, outer SGD lr 0.7 Nesterov 0.9"),
    "diloco-sidco-exp-0.01-h10": Method("sidco-exp", {"ratio": 0.01, "outer_lr": 0.7, "outer_momentum": 0.9,
                                                      "residual_decay": 1.0}, flags=("--sync-every", "10"),
                                        setting="DiLoCo, H 10, sidco-exp 0.01 + error feedback, outer as dense"),
    "sparseloco-sidco-exp-0.01-h10": Method(
        "sidco-exp", {"ratio": 0.01, "residual_decay": 0.95, "outer_momentum": 0.0, "outer_lr": 1.0},
        flags=("--sync-every", "10"),
        setting="SparseLoCo's form, H 10: error feedback with decay 0.95 instead of outer momentum, outer lr 1"),
    "diloco-h20": Method("none", {"outer_lr": 0.7, "outer_momentum": 0.9}, flags=("--sync-every", "20"),
                         setting="DiLoCo, H 20, fp32 pseudo-gradient, outer SGD lr 0.7 Nesterov 0.9"),
    "sparseloco-sidco-exp-0.01-h20": Method(
        "sidco-exp", {"ratio": 0.01, "residual_decay": 0.95, "outer_momentum": 0.0, "outer_lr": 1.0},
        flags=("--sync-every", "20"), setting="SparseLoCo's form as at H 10, H 20"),
    "sparseloco-sidco-exp-0.01-h20-bf16": Method(
        "sidco-exp", {"ratio": 0.01, "residual_decay": 0.95, "outer_momentum": 0.0, "outer_lr": 1.0,
                      "value_dtype": "bf16"},
        flags=("--sync-every", "20"), setting="SparseLoCo's form at H 20, the selected values sent in bf16"),
    "sparse-avg-sidco-exp-0.01-h10": Method(
        "sidco-exp", {"ratio": 0.01, "outer_momentum": 0.0, "outer_lr": 1.0, "residual_decay": 1.0},
        flags=("--sync-every", "10"),
        setting="H 10, sidco-exp 0.01 + plain error feedback, averaged (outer lr 1, no momentum)"),
    "alone": Method("none", flags=("--workers", "1"),
                    setting="one worker alone at the per-worker batch, no communication (the zero-byte control)"),
    "topk-0.01-dw16": Method("topk", {"ratio": 0.01}, flags=("--dense-warmup-steps", "16"),
                             setting="ratio 0.01, the recipe with 16 dense warm-up steps (5 % of 314)"),
    "topk-0.01-dw64": Method("topk", {"ratio": 0.01}, flags=("--dense-warmup-steps", "64"),
                             setting="ratio 0.01, the recipe with 64 dense warm-up steps (20 % of 314)"),
    "topk-0.01-dw128": Method("topk", {"ratio": 0.01}, flags=("--dense-warmup-steps", "128"),
                              setting="ratio 0.01, the recipe with 128 dense warm-up steps (41 % of 314)"),
    "qavg-blockquant8-h10": Method("blockquant", {"bits": 8, "outer_lr": 1.0, "outer_momentum": 0.0},
                                   flags=("--sync-every", "10"),
                                   setting="quantized periodic averaging, H 10: the delta in 8-bit codes, absmax per 64, "
                                           "error feedback with decay 0.95"),
    "qavg-blockquant4-h10": Method("blockquant", {"bits": 4, "outer_lr": 1.0, "outer_momentum": 0.0},
                                   flags=("--sync-every", "10"), setting="as qavg-blockquant8-h10 in 4-bit codes"),
    "qavg-blockquant2-h10": Method("blockquant", {"bits": 2, "outer_lr": 1.0, "outer_momentum": 0.0},
                                   flags=("--sync-every", "10"), setting="as qavg-blockquant8-h10 in 2-bit (ternary) codes"),
    "qavg-blockquant2-h20": Method("blockquant", {"bits": 2, "outer_lr": 1.0, "outer_momentum": 0.0},
                                   flags=("--sync-every", "20"), setting="2-bit codes every 20 steps"),
    "cocktail-h1": Method("cocktail", {"outer_lr": 1.0, "outer_momentum": 0.0, "residual_decay": 1.0},
                          flags=("--sync-every", "1"),
                          setting="per-step delta sync in CocktailSGD's manner: AdamW local, every step the delta "
                                  "through a rolling 10 % subset, its top 20 %, 4-bit values; plain error feedback"),
    "cocktail-h1-model": Method("cocktail", {"outer_lr": 1.0, "outer_momentum": 0.0, "residual_decay": 1.0,
                                             "unsent": "model"}, flags=("--sync-every", "1"),
                                setting="as cocktail-h1, the unsent delta kept in each worker's parameters "
                                        "(CocktailSGD's way)"),
    "onebit-adam": Method("efsignsgd", setting="1-bit Adam's anchor: the hook's frozen-variance AdamW (the trainer's "
                                               "dense warm-up) with scaled signs and worker error feedback"),
    "onebit-adam-server": Method("onebit", {"adam": "onebit", "server_feedback": True},
                                 setting="1-bit Adam as written (Tang et al. 2021): frozen-variance AdamW after the trainer's "
                                         "dense warm-up, (||x||_2/sqrt(d)) sign(x) per bucket, worker and server error "
                                         "feedback, each worker's momentum restarted from the exchanged one"),
    "zero-one-q4w300-l500x2": Method("efsignsgd", {"warmup_steps": 300, "warmup_compressor": "blockquant",
                                                   "adam": "zero-one", "local_steps": [500, 2]},
                                     setting="0/1 Adam's local steps (adam='zero-one'): a 300-step warm-up in 4-bit "
                                             "codes, then the 1-bit message once per interval, the interval doubling "
                                             "every 500 compressed steps up to 2"),
    "demo": Method("none", flags=("--optimizer", "demo", "--lr", "0.001"),
                   setting="DeMo's anchor (gradsift.DeMo in AdamW's place, no DDP): momentum 0.999 as the error-feedback "
                           "buffer, DCT of 64x64 tiles, top 32 coefficients each (fp32 values, int16 indices: 85x fewer "
                           "bytes on the matrices), sign steps; lr 1e-3, the best of a screen of 3e-4, 1e-3 and 3e-3 (a sign step "
                           "moves every coordinate by lr), no weight decay (the paper's runs)"),
    "demo-lr3e-4": Method("none", flags=("--optimizer", "demo", "--lr", "0.0003"),
                          setting="as demo, lr 3e-4 (the anchor's learning-rate screen)"),
    "demo-lr3e-3": Method("none", flags=("--optimizer", "demo", "--lr", "0.003"),
                          setting="as demo, lr 3e-3 (AdamW's; the anchor's learning-rate screen)"),
}  # fmt: skip

#: The four methods every workload runs (VGG: with every seed).
HEADLINE = ("none", "bf16", "sidco-exp-0.01", "topk-0.01")


@dataclass(frozen=True)
class Run:
    """One planned run."""

    workload: str
    method: str
    seed: int
    epochs: float

    @property
    def name(self) -> str:
        return f"{self.method}-e{self.epochs:g}-s{self.seed}"

    @property
    def directory(self) -> Path:
        return RUNS / self.workload / self.name

    def arguments(self) -> list[str]:
        workload, method = WORKLOADS[self.workload], METHODS[self.method]
        return [*workload.train_arguments(self.epochs), *method.train_arguments(), "--seed", str(self.seed)]


def study_runs() -> list[Run]:
    """fp32 at every study length, seed 0: the curves that decide ``epochs``. The
    longest length of each workload (the plateau check) comes after all the others."""
    plan = [Run(name, "none", 0, e) for name, w in WORKLOADS.items() for e in w.study_epochs]
    return sorted(plan, key=lambda run: run.epochs == max(WORKLOADS[run.workload].study_epochs))


def accuracy_runs(error_feedback: bool | None = None) -> list[Run]:
    """The campaign in priority order: VGG headline x 3 seeds, VGG every other SGD method
    (seed 0; the AdamW campaign's own methods -- local-AdamW modes, Adam anchors, its
    controls -- are not SGD methods), then the other workloads' headline methods (seed 0).
    ``error_feedback`` keeps only the methods with (True) or without (False) error feedback."""
    vgg = WORKLOADS["vgg"]
    plan = [Run("vgg", m, s, vgg.epochs) for s in vgg.seeds for m in HEADLINE]
    plan += [Run("vgg", m, 0, vgg.epochs) for m in METHODS if m not in (*HEADLINE, *ADAMW, *CAMPAIGN44)]
    for name in ("resnet20", "lstm", "gpt"):
        plan += [Run(name, m, 0, WORKLOADS[name].epochs) for m in HEADLINE]
    if error_feedback is not None:
        plan = [r for r in plan if METHODS[r.method].error_feedback == error_feedback]
    return plan


#: The AdamW campaign's methods (``gpt-adamw``): the dense baselines, the issue's failure
#: (error feedback alone), the recipe's frozen-variance AdamW, DiLoCo dense and compressed,
#: and the anchors (1-bit Adam -- the hook's scaled signs, then the method as written with
#: both residuals, appended last so that finished runs keep their places --, DeMo).
ADAMW = ("none", "bf16", "topk-0.01-no-recipe", "topk-0.01", "sidco-exp-0.01", "diloco-h10",
         "diloco-sidco-exp-0.01-h10", "sparseloco-sidco-exp-0.01-h10", "topk-0.01-adam-update",
         "sidco-exp-0.01-fit", "diloco-avg-h10", "diloco-h20", "sparseloco-sidco-exp-0.01-h20",
         "sparseloco-sidco-exp-0.01-h20-bf16", "sparse-avg-sidco-exp-0.01-h10",
         "alone", "topk-0.01-dw16", "topk-0.01-dw64", "topk-0.01-dw128",
         "qavg-blockquant8-h10", "qavg-blockquant4-h10", "qavg-blockquant2-h10", "qavg-blockquant2-h20",
         "onebit-adam", "cocktail-h1", "cocktail-h1-model", "demo", "demo-lr3e-4", "demo-lr3e-3",
         "onebit-adam-server")  # fmt: skip


#: AdamW methods whose runs are issue 44's campaign's (``campaign44.py``), here for their whole
#: emulated runs (:data:`VALIDATION_RUNS`): in no plan of this module.
CAMPAIGN44 = ("zero-one-q4w300-l500x2",)


#: The methods also run on 4 workers: the controls (fp32, bf16, one worker alone, dense
#: averaging every 10 steps), the recipe, SparseLoCo's form, and the best compressed
#: local-AdamW modes of the 2-worker screen (4-bit quantized averaging, CocktailSGD's way).
ADAMW_W4 = ("none", "bf16", "topk-0.01", "sparseloco-sidco-exp-0.01-h10", "alone", "diloco-avg-h10",
            "qavg-blockquant4-h10", "cocktail-h1-model")  # fmt: skip


#: The methods also run at 1,000 steps: the controls, the recipe, averaging and SparseLoCo's form.
ADAMW_1K = ("none", "alone", "topk-0.01", "diloco-avg-h10", "sparseloco-sidco-exp-0.01-h10")

#: The same methods at 3,000 steps (the slope of each gap with run length), quantized
#: periodic averaging at 4 and 8 bits, the best of its 314-step screen, the bf16 control,
#: CocktailSGD's per-step delta sync and the 1-bit Adam anchor (and 1-bit Adam as written).
ADAMW_3K = (*ADAMW_1K, "qavg-blockquant4-h10", "qavg-blockquant8-h10", "bf16", "cocktail-h1-model",
            "onebit-adam", "onebit-adam-server")  # fmt: skip


#: The 4-worker methods at 1,000 steps: the controls and the best mode of each family.
ADAMW_W4_1K = ("none", "alone", "topk-0.01", "diloco-avg-h10", "qavg-blockquant4-h10", "cocktail-h1-model")

#: The 4-worker methods at 3,000 steps: the controls (fp32, one worker alone, dense averaging
#: every 10 steps) and each family's best at 2 workers and 3,000 steps (the per-step hook with
#: 1-bit Adam's scaled signs, 4-bit averaging, CocktailSGD's way), then the bf16 control
#: (appended: the finished runs keep their places); seed by seed, so that a partial
#: campaign holds whole seeds of every method.
ADAMW_W4_3K = ("none", "alone", "onebit-adam", "diloco-avg-h10", "qavg-blockquant4-h10", "cocktail-h1-model",
               "bf16")  # fmt: skip


def adamw_runs() -> list[Run]:
    """The AdamW campaign, seed by seed (every method's seed 0 first), 2 workers, 4, then 1,000 and 3,000 steps."""
    plan = []
    for name, methods in (
        ("gpt-adamw", ADAMW),
        ("gpt-adamw-w4", ADAMW_W4),
        ("gpt-adamw-1k", ADAMW_1K),
        ("gpt-adamw-3k", ADAMW_3K),
        ("gpt-adamw-w4-1k", ADAMW_W4_1K),
        ("gpt-adamw-w4-3k", ADAMW_W4_3K),
    ):
        workload = WORKLOADS[name]
        plan += [Run(name, m, s, workload.epochs) for s in workload.seeds for m in methods]
    return plan


#: Steps of a timing run (analyze.py takes the median step time per message size; 40 steps
#: hold four syncs of a method that averages every 10).
TIMING_STEPS = 40
LINKS = ("100mbit", "1gbit")
#: The hook's density warm-up knobs (see gradsift.hook.recipe) and its first density.
WARMUP_STEPS_OPTION, WARMUP_START_OPTION, WARMUP_START = "density_warmup_steps", "density_warmup_start", 0.25


@dataclass(frozen=True)
class TimingRun:
    """Step times of one method on one emulated link, per message size (one size for most
    methods; two for those that sync every H steps or warm up dense).

    ``at_start``: the density warm-up's first density (the error-feedback sparsifiers'
    largest message) instead of the target ratio; both run with the warm-up off, so
    every step sends the same size."""

    workload: str
    method: str
    link: str
    at_start: bool = False

    @property
    def directory(self) -> Path:
        return (
            RESULTS
            / "timing"
            / self.workload
            / f"{self.method}-{self.link}{'-start' if self.at_start else ''}"
        )

    def arguments(self) -> list[str]:
        workload, method = WORKLOADS[self.workload], METHODS[self.method]
        arguments = [
            *workload.train_arguments(workload.epochs, steps=TIMING_STEPS),
            *method.train_arguments(),
        ]
        if warms_up(self.workload, self.method):
            arguments += ["--option", f"{WARMUP_STEPS_OPTION}=0"]
            if self.at_start:
                arguments += ["--ratio", str(WARMUP_START)]
        return [*arguments, "--seed", "0", "--bandwidth", self.link]


def warms_up(workload: str, method: str) -> bool:
    """Whether the trainer's default density warm-up applies: error feedback and a ratio,
    under SGD (under AdamW the hook's warm-up is dense steps instead, each stock DDP's)."""
    return (
        WORKLOADS[workload].optimizer != "adamw"
        and METHODS[method].error_feedback
        and "ratio" in METHODS[method].options
    )


#: The AdamW workloads whose runs get a time axis: the longest, at 2 and at 4 workers, every
#: method of each but one worker alone, which sends nothing and whose one process gets both
#: of this machine's cores (0.03 s a step against 0.056 s for a local step of two workers
#: sharing them).
ADAMW_TIMED = {"gpt-adamw-3k": ADAMW_3K, "gpt-adamw-w4-3k": ADAMW_W4_3K}


def timing_runs() -> list[TimingRun]:
    """Every method of the SGD campaign and of the timed AdamW workloads on both links (and
    the density warm-up's start size where it applies), in plan order."""
    pairs = [(r.workload, r.method) for r in accuracy_runs()] + [
        (workload, m) for workload, methods in ADAMW_TIMED.items() for m in methods if m != "alone"
    ]
    plan = []
    for workload, method in dict.fromkeys(pairs):
        for link in LINKS:
            plan.append(TimingRun(workload, method, link))
            if warms_up(workload, method):
                plan.append(TimingRun(workload, method, link, at_start=True))
    return plan


@dataclass(frozen=True)
class ValidationRun:
    """A full protocol run over an emulated link, to check the composed time axis."""

    workload: str
    method: str
    link: str

    @property
    def directory(self) -> Path:
        return RESULTS / "validation" / self.workload / f"{self.method}-{self.link}"

    def arguments(self) -> list[str]:
        return [*Run(self.workload, self.method, 0, WORKLOADS[self.workload].epochs).arguments(),
                "--bandwidth", self.link]  # fmt: skip


#: One full emulated run per headline pair (sidco-exp against fp32 and against bf16) on VGG;
#: then issue 44's check of its composed times: fp32 and the 1-bit Adam arm, 3,000 steps of the
#: AdamW GPT, over each link (docs/adam.md publishes a composed time only within 10 % of these).
VALIDATION_RUNS = [ValidationRun("vgg", m, "100mbit") for m in ("sidco-exp-0.01", "none", "bf16")] + [
    ValidationRun("gpt-adamw-3k", m, link)
    for link in LINKS
    for m in ("none", "onebit-adam", "zero-one-q4w300-l500x2")
]


@dataclass(frozen=True)
class DefaultsRun:
    """One epoch of VGG with nothing but ``gradsift train``'s defaults (constant lr 0.05,
    batch 32, momentum 0.9 -- and DGC's recipe for the error-feedback sparsifiers), the
    issue's seed 3: the target says sidco-exp and topk at 0.01 end within 0.5 point of fp32."""

    method: str
    seed: int = 3
    workload: str = "vgg-defaults"

    @property
    def name(self) -> str:
        return f"{self.method}-e1-s{self.seed}"

    @property
    def directory(self) -> Path:
        return RUNS / self.workload / self.name

    def arguments(self) -> list[str]:
        return ["--model", "vgg", "--workers", str(WORKERS), "--epochs", "1", "--eval-every", "117",
                "--data-dir", FASHION_MNIST, *METHODS[self.method].train_arguments(), "--seed", str(self.seed)]  # fmt: skip


DEFAULTS_RUNS = [DefaultsRun(m) for m in ("none", "sidco-exp-0.01", "topk-0.01")]
