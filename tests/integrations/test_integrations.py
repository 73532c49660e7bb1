"""Extras, telemetry flattening, TensorBoard output and the Lightning callback's contract."""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from gradsift.core.errors import InvalidOptionError, MissingExtraError, UntrustedDataError
from gradsift.core.extras import EXTRAS, install_hint, require
from gradsift.integrations.telemetry import scalar_metrics
from support.package import read_pyproject


# -- extras -----------------------------------------------------------------------------
def test_missing_extra_names_the_pip_command() -> None:
    with pytest.raises(MissingExtraError, match=r"pip install 'gradsift\[lightning\]'") as info:
        require("gradsift_no_such_module", "lightning")
    assert isinstance(info.value, ImportError)
    assert "gradsift_no_such_module" in str(info.value)


def test_require_returns_the_module() -> None:
    assert require("math", "plot") is math


def test_unknown_extra_is_rejected_with_the_known_ones() -> None:
    with pytest.raises(InvalidOptionError, match="extra must be one of plot, tensorboard"):
        install_hint("gpu")


def test_every_extra_is_a_pyproject_extra_and_the_tests_install_them() -> None:
    optional = read_pyproject()["project"]["optional-dependencies"]
    assert set(EXTRAS) <= set(optional)
    assert "gradsift[tensorboard,lightning,accelerate,transformers,docs]" in optional["test"]


@pytest.mark.parametrize(
    "saved", [None, {"ranks": [{}]}, {"world_size": 1}, [{"world_size": 1, "ranks": [{}]}]], ids=repr
)
def test_load_hook_state_refuses_what_gather_hook_states_did_not_return(saved) -> None:
    from gradsift.hook.state import GradsiftHookState
    from gradsift.integrations.checkpoint import load_hook_state

    with pytest.raises(
        InvalidOptionError,
        match=r"saved must be the dict gather_hook_states returned \(keys world_size, ranks\)",
    ):
        load_hook_state(GradsiftHookState.build("topk", ratio=0.1), saved)


# -- telemetry ----------------------------------------------------------------------------
def test_scalar_metrics_flattens_numbers_and_drops_the_rest() -> None:
    stats = {
        "step": {"bytes_sent": 448, "density": 0.01, "skipped": False, "nan": math.nan},
        "total": {"compress_ms": torch.tensor(1.5), "vector": torch.ones(3), "name": "topk", "none": None},
    }
    assert scalar_metrics(stats) == {
        "gradsift/step/bytes_sent": 448.0,
        "gradsift/step/density": 0.01,
        "gradsift/step/skipped": 0.0,
        "gradsift/total/compress_ms": 1.5,
    }
    assert scalar_metrics({"a": 1}, prefix="") == {"a": 1.0}


def test_scalar_metrics_rejects_a_non_mapping() -> None:
    with pytest.raises(InvalidOptionError, match="stats must be a mapping"):
        scalar_metrics([1, 2])  # type: ignore[arg-type]


def test_tensorboard_event_file_holds_the_stats(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="pip install 'gradsift[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gradsift.integrations.tensorboard import open_writer, write_stats

    writer = open_writer(tmp_path)
    for step in range(3):
        write_stats(writer, {"step": {"bytes_sent": 100 * step, "name": "x"}}, step)
    with pytest.raises(InvalidOptionError, match="step must lie in"):
        write_stats(writer, {}, -1)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert events.Tags()["scalars"] == ["gradsift/step/bytes_sent"]
    scalars = events.Scalars("gradsift/step/bytes_sent")
    assert [(s.step, s.value) for s in scalars] == [(0, 0.0), (1, 100.0), (2, 200.0)]


# -- Lightning callback, in a one-process gloo group --------------------------------------
def _ddp_model() -> DistributedDataParallel:
    torch.manual_seed(0)
    return DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)))


def _train_step(ddp_model: DistributedDataParallel) -> None:
    ddp_model(torch.randn(8, 16)).square().mean().backward()


@pytest.mark.distributed
def test_lightning_pair_fits_lightnings_registration(one_process_group: None) -> None:
    pytest.importorskip("pytorch_lightning", reason="pip install 'gradsift[lightning]'")
    from pytorch_lightning.overrides.distributed import _register_ddp_comm_hook

    from gradsift.integrations.lightning import GradsiftCallback

    callback = GradsiftCallback("topk", ratio=0.1)
    ddp_model = _ddp_model()
    _register_ddp_comm_hook(ddp_model, **callback.strategy_kwargs())  # what DDPStrategy does on CUDA
    callback.on_fit_start(
        SimpleNamespace(strategy=SimpleNamespace(model=ddp_model)), None
    )  # binds, no 2nd register
    _train_step(ddp_model)
    total = callback.state.stats()["total"]
    assert total["steps"] == 1
    assert 0 < total["bytes_sent"] < total["dense_bytes"] / 4

    # a fresh callback restores the saved (gathered) hook state: residuals equal. Lightning
    # restores callbacks before it places and wraps the model: the entry waits for on_fit_start.
    saved = callback.state_dict()
    assert saved["world_size"] == 1
    restored = GradsiftCallback("topk", ratio=0.1)
    restored.load_state_dict(saved)
    assert "residual" not in restored.state.state_dict()["store"]["tables"]
    restored.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(model=_ddp_model())), None)
    before = saved["ranks"][0]["store"]["tables"]["residual"]
    after = restored.state.state_dict()["store"]["tables"]["residual"]
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert any(bool(t.abs().sum() > 0) for t in before.values())
    with pytest.raises(InvalidOptionError, match="world_size=1"):
        restored.load_state_dict({**saved, "world_size": 2})


@pytest.mark.distributed
def test_lightning_callback_registers_where_lightning_did_not(one_process_group: None) -> None:
    pytest.importorskip("pytorch_lightning", reason="pip install 'gradsift[lightning]'")
    from gradsift.integrations.lightning import GradsiftCallback

    callback = GradsiftCallback("topk", ratio=0.1, granularity="layer")
    ddp_model = _ddp_model()
    callback.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(model=ddp_model)), None)
    _train_step(ddp_model)
    assert callback.state.stats()["total"]["compressed_tensors"] == 4  # one per parameter
    with pytest.raises(InvalidOptionError, match="needs a DDP strategy"):
        callback.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(model=torch.nn.Linear(2, 2))), None)
    with pytest.raises(InvalidOptionError, match="not hook options"):
        GradsiftCallback(callback.state.compressor, ratio=0.1)


@pytest.mark.distributed
def test_lightning_callback_hands_the_hook_the_trainers_optimizer(one_process_group: None) -> None:
    pytest.importorskip("pytorch_lightning", reason="pip install 'gradsift[lightning]'")
    from gradsift.integrations.lightning import GradsiftCallback

    ddp_model = _ddp_model()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)
    trainer = SimpleNamespace(strategy=SimpleNamespace(model=ddp_model), optimizers=[optimizer])
    callback = GradsiftCallback("topk", ratio=0.1)
    callback.on_fit_start(trainer, None)
    assert callback.state.feedback.momentum == 0.9  # taken over, as optimizer= does
    assert optimizer.param_groups[0]["momentum"] == 0.0
    kept = GradsiftCallback("topk", take_optimizer=False, ratio=0.1)
    other = torch.optim.SGD(_ddp_model().parameters(), lr=0.1, momentum=0.9)
    kept.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(model=_ddp_model()), optimizers=[other]), None)
    assert kept.state.feedback.momentum == 0.0 and other.param_groups[0]["momentum"] == 0.9
    two = SimpleNamespace(strategy=SimpleNamespace(model=_ddp_model()), optimizers=[other, optimizer])
    with pytest.raises(InvalidOptionError, match="take_optimizer=False"):
        GradsiftCallback("topk", ratio=0.1).on_fit_start(two, None)


@pytest.mark.distributed
def test_a_trainers_optimizer_the_method_cannot_take_is_refused_in_the_callbacks_words(
    one_process_group: None,
) -> None:
    """Adagrad (as Adafactor or LAMB) has no momentum the hook can take over: a callback's named
    error-feedback method refuses it naming ``take_optimizer=False``, not ``register_comm_hook``'s
    ``optimizer=False``, and takes it with ``take_optimizer=False`` or under ``auto``."""
    pytest.importorskip("pytorch_lightning", reason="pip install 'gradsift[lightning]'")
    from gradsift.integrations.lightning import GradsiftCallback

    def trainer() -> SimpleNamespace:
        ddp_model = _ddp_model()
        optimizer = torch.optim.Adagrad(ddp_model.parameters(), lr=0.1)
        return SimpleNamespace(strategy=SimpleNamespace(model=ddp_model), optimizers=[optimizer])

    with pytest.raises(
        InvalidOptionError, match=r"is Adagrad, whose momentum 'topk' cannot take over .*take_optimizer=False"
    ):
        GradsiftCallback("topk", ratio=0.1).on_fit_start(trainer(), None)
    for callback in (
        GradsiftCallback("topk", take_optimizer=False, ratio=0.1),
        GradsiftCallback("bf16"),
        GradsiftCallback(),
    ):
        taken = trainer()
        callback.on_fit_start(taken, None)
        _train_step(taken.strategy.model)


@pytest.mark.distributed
def test_lightning_callback_defaults_to_auto_and_registers_it_itself(one_process_group: None) -> None:
    """``GradsiftCallback()`` is ``auto``: nothing to offer DDPStrategy, its state from
    on_fit_start, stock DDP's gradients while it measures, a decision at the first bucket after
    the deciding step (no optimizer to decide after), and the
    state (the choice with it) restored by a fresh callback; a ratio is refused, not ignored."""
    pytest.importorskip("pytorch_lightning", reason="pip install 'gradsift[lightning]'")
    from gradsift.hook.auto import DECIDE_AT, AutoHookState
    from gradsift.integrations.lightning import GradsiftCallback

    callback = GradsiftCallback()
    assert callback.strategy_kwargs() == {}
    with pytest.raises(
        InvalidOptionError, match="compressor='auto' builds its hook state from the DDP model.*ddp_spawn"
    ):
        callback.state  # noqa: B018 -- the property raises
    ddp_model, stock = _ddp_model(), _ddp_model()  # stock: DDP's own allreduce
    callback.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(model=ddp_model)), None)
    assert isinstance(callback.state, AutoHookState)
    for step in range(DECIDE_AT + 2):
        batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for model in (ddp_model, stock):
            model.zero_grad(set_to_none=True)
            model(batch).square().mean().backward()
        if step <= DECIDE_AT:
            assert all(
                torch.equal(a.grad, b.grad)
                for a, b in zip(ddp_model.parameters(), stock.parameters(), strict=True)
            )
    chosen = callback.state.stats()["auto"]
    assert chosen["decided_at"] == DECIDE_AT + 1 and chosen["choice"] in (
        "none",
        "bf16",
    )  # no optimizer: "other"

    restored = GradsiftCallback()
    restored.load_state_dict(callback.state_dict())
    restored.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(model=_ddp_model())), None)
    assert restored.state.stats()["auto"]["choice"] == chosen["choice"]
    assert restored.state.step == callback.state.step == DECIDE_AT + 2

    with pytest.raises(
        InvalidOptionError, match="compressor='auto' picks the method and its options; got ratio"
    ):
        GradsiftCallback(ratio=0.1).on_fit_start(
            SimpleNamespace(strategy=SimpleNamespace(model=_ddp_model())), None
        )


# -- Hugging Face Trainer callback, in a one-process gloo group ----------------------------
def test_trainer_callback_without_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    monkeypatch.delitem(sys.modules, "gradsift.integrations.transformers", raising=False)
    with pytest.raises(MissingExtraError, match=r"pip install 'gradsift\[transformers\]'"):
        importlib.import_module("gradsift.integrations.transformers")


def _trainer_events(
    tmp_path: Path, step: int, resume_from: str | None = None, max_steps: int = 40
) -> tuple[SimpleNamespace, ...]:
    """``(args, state, control)`` as the Trainer passes them to a callback event."""
    args = SimpleNamespace(output_dir=str(tmp_path), resume_from_checkpoint=resume_from)
    return args, SimpleNamespace(global_step=step, max_steps=max_steps), SimpleNamespace()


@pytest.mark.distributed
def test_trainer_callback_registers_saves_each_rank_and_restores(
    one_process_group: None, tmp_path: Path
) -> None:
    pytest.importorskip("transformers", reason="pip install 'gradsift[transformers]'")
    from gradsift.integrations.transformers import GradsiftTrainerCallback

    ddp_model = _ddp_model()
    trainer = SimpleNamespace(model_wrapped=ddp_model)
    callback = GradsiftTrainerCallback(trainer, "topk", ratio=0.1)
    callback.on_train_begin(*_trainer_events(tmp_path, 0))
    callback.on_train_begin(*_trainer_events(tmp_path, 0))  # a second train(): the hook stays registered once
    _train_step(ddp_model)
    assert (
        0 < callback.state.stats()["total"]["bytes_sent"] < callback.state.stats()["total"]["dense_bytes"] / 4
    )
    callback.on_save(*_trainer_events(tmp_path, 1))
    saved = tmp_path / "checkpoint-1" / "gradsift_hook_state_0.pt"
    assert saved.is_file()

    # a resumed run (global_step 1 at on_train_begin) restores the residuals from OUTPUT_DIR/checkpoint-1
    resumed = GradsiftTrainerCallback(SimpleNamespace(model_wrapped=_ddp_model()), "topk", ratio=0.1)
    resumed.on_train_begin(*_trainer_events(tmp_path, 1))
    before = callback.state.state_dict()["store"]["tables"]["residual"]
    after = resumed.state.state_dict()["store"]["tables"]["residual"]
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert any(bool(t.abs().sum() > 0) for t in before.values())

    # with torch_compile=True the Trainer's model_wrapped is torch.compile's wrapper of the DDP model
    inner = _ddp_model()
    compiled = GradsiftTrainerCallback(
        SimpleNamespace(model_wrapped=torch.compile(inner, backend="eager")), "topk", ratio=0.1
    )
    compiled.on_train_begin(*_trainer_events(tmp_path, 0))
    assert compiled.state.hooked == list(inner.module.parameters())

    # the folder comes from resume_from, else TrainingArguments.resume_from_checkpoint
    moved = tmp_path / "moved"
    (tmp_path / "checkpoint-1").rename(moved)
    explicit = GradsiftTrainerCallback(SimpleNamespace(model_wrapped=_ddp_model()), "topk", ratio=0.1)
    explicit.on_train_begin(*_trainer_events(tmp_path, 1, resume_from=str(moved)))
    assert explicit.state.step == callback.state.step == 1


@pytest.mark.distributed
def test_trainer_callback_refuses_what_would_not_continue_the_run(
    one_process_group: None, tmp_path: Path
) -> None:
    pytest.importorskip("transformers", reason="pip install 'gradsift[transformers]'")
    from gradsift.integrations.transformers import GradsiftTrainerCallback

    def fresh(**options) -> GradsiftTrainerCallback:
        return GradsiftTrainerCallback(
            SimpleNamespace(model_wrapped=_ddp_model()), "topk", ratio=0.1, **options
        )

    with pytest.raises(InvalidOptionError, match="needs the Trainer to train with DistributedDataParallel"):
        GradsiftTrainerCallback(SimpleNamespace(model_wrapped=torch.nn.Linear(2, 2)), "topk").on_train_begin(
            *_trainer_events(tmp_path, 0)
        )
    with pytest.raises(InvalidOptionError, match=r"resumed at step 3 but .*checkpoint-3.* does not exist"):
        fresh().on_train_begin(*_trainer_events(tmp_path, 3))
    saver = fresh()
    saver.on_train_begin(*_trainer_events(tmp_path, 0))
    path = saver.save(tmp_path / "checkpoint-3", global_step=2)  # a file of another step
    with pytest.raises(InvalidOptionError, match="holds the hook state of step 2"):
        fresh().on_train_begin(*_trainer_events(tmp_path, 3))
    torch.save({**torch.load(path, weights_only=True), "world_size": 2, "global_step": 3}, path)
    with pytest.raises(InvalidOptionError, match="world_size=1"):
        fresh().on_train_begin(*_trainer_events(tmp_path, 3))
    marker = tmp_path / "ran"
    torch.save({"world_size": 1, "global_step": 3, "hook": _MakesDirectory(marker)}, path)
    with pytest.raises(UntrustedDataError, match=r"gradsift_hook_state_0\.pt refused.*GLOBAL posix\.mkdir"):
        fresh().on_train_begin(*_trainer_events(tmp_path, 3))
    assert not marker.exists()  # the file's object was never built
    with pytest.raises(InvalidOptionError, match="not hook options"):
        GradsiftTrainerCallback(None, saver.state.compressor, ratio=0.1)


@pytest.mark.distributed
def test_trainer_callback_defaults_to_auto_told_the_runs_length(
    one_process_group: None, tmp_path: Path
) -> None:
    """``GradsiftTrainerCallback(trainer)`` registers ``auto`` at on_train_begin with the
    Trainer's ``max_steps`` as the run's length (an explicit ``steps`` wins), and its saved
    state -- the choice in it -- restores into a resumed run's auto."""
    pytest.importorskip("transformers", reason="pip install 'gradsift[transformers]'")
    from gradsift.hook.auto import DECIDE_AT, AutoHookState
    from gradsift.integrations.transformers import GradsiftTrainerCallback

    def begin(callback: GradsiftTrainerCallback, step: int) -> None:
        callback.on_train_begin(*_trainer_events(tmp_path, step, max_steps=5000))

    ddp_model = _ddp_model()
    callback = GradsiftTrainerCallback(SimpleNamespace(model_wrapped=ddp_model))
    begin(callback, 0)
    assert isinstance(callback.state, AutoHookState) and callback.state.run_steps == 5000
    for _ in range(DECIDE_AT + 2):
        _train_step(ddp_model)
    choice = callback.state.stats()["auto"]["choice"]
    assert choice in ("none", "bf16")
    callback.on_save(*_trainer_events(tmp_path, DECIDE_AT + 2))

    resumed = GradsiftTrainerCallback(SimpleNamespace(model_wrapped=_ddp_model()))
    begin(resumed, DECIDE_AT + 2)
    assert resumed.state.stats()["auto"]["choice"] == choice and resumed.state.step == DECIDE_AT + 2

    told = GradsiftTrainerCallback(SimpleNamespace(model_wrapped=_ddp_model()), steps=40)
    begin(told, 0)
    assert told.state.run_steps == 40


class _MakesDirectory:
    """Pickles as ``os.mkdir(marker)``: loading it with plain pickle makes the directory."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.marker,))
