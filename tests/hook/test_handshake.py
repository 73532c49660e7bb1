"""The settings handshake: ranks given different settings stop at registration, every rank with
an error naming the setting and each rank's value; ranks that differ only in per-rank options
(log paths) train.

Each pair below made two gloo ranks train apart silently, hang until the group's timeout, or
abort inside gloo before the handshake (issue 46); the expected line of each error is written
out by hand.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.agreement import check_agreement, disagreement, setting_text, tensors_text
from gradsift.core.errors import InvalidOptionError, SettingsMismatchError
from gradsift.hook.handshake import PER_RANK, hook_settings
from gradsift.hook.options import HookOptions
from gradsift.hook.state import GradsiftHookState
from support.distributed import run_workers
from support.models import batch, flat_params, make_model

#: case -> ((compressor, options) of rank 0, of rank 1, the error's line naming the setting)
HOOK_PAIRS = {
    "value_dtype": (("topk", {"ratio": 0.1, "value_dtype": "fp16"}), ("topk", {"ratio": 0.1, "value_dtype": "bf16"}),
                    '  value_dtype: "float16" on rank 0; "bfloat16" on rank 1'),
    "randomk seed": (("randomk", {"ratio": 0.1, "seed": 0}), ("randomk", {"ratio": 0.1, "seed": 1}),
                     "  compressor option seed: 0 on rank 0; 1 on rank 1"),
    "none vs topk": (("none", {}), ("topk", {"ratio": 0.01}), '  compressor: "none" on rank 0; "topk" on rank 1'),
    "warmup_steps": (("topk", {"ratio": 0.1, "warmup_steps": 0}), ("topk", {"ratio": 0.1, "warmup_steps": 2}),
                     "  warmup_steps: 0 on rank 0; 2 on rank 1"),
    "ratio": (("topk", {"ratio": 0.01}), ("topk", {"ratio": 0.1}),
              "  compressor option ratio: 0.01 on rank 0; 0.1 on rank 1"),
    "qsgd vs terngrad": (("qsgd", {}), ("terngrad", {}), '  compressor: "qsgd" on rank 0; "terngrad" on rank 1'),
    "granularity": (("topk", {"ratio": 0.1}), ("topk", {"ratio": 0.1, "granularity": "layer"}),
                    '  granularity: "bucket" on rank 0; "layer" on rank 1'),
}  # fmt: skip


def _refused(setup) -> dict:
    """What ``setup()`` raised (its text) and how long it took."""
    started = time.monotonic()
    try:
        setup()
    except SettingsMismatchError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def _demo(chunk: int) -> None:
    gradsift.DeMo(make_model().parameters(), lr=0.01, chunk=chunk, topk=4)


def _diloco(sync_every: int) -> None:
    model = make_model()
    gradsift.diloco(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=sync_every)


def _fsdp(ratio: float) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    model = FullyShardedDataParallel(
        make_model(), sharding_strategy=ShardingStrategy.NO_SHARD, device_id=torch.device("cpu")
    )
    gradsift.register_comm_hook(model, "topk", ratio=ratio)


def worker(rank: int, world: int, directory: str) -> dict:
    results = {}
    for case, pair in HOOK_PAIRS.items():
        compressor, options = pair[rank]
        results[case] = _refused(
            lambda c=compressor, o=options: gradsift.register_comm_hook(DDP(make_model()), c, **o)
        )
    results["DeMo chunk"] = _refused(lambda: _demo((8, 16)[rank]))
    results["diloco sync_every"] = _refused(lambda: _diloco((5, 10)[rank]))
    results["FSDP ratio"] = _refused(lambda: _fsdp((0.01, 0.1)[rank]))

    # per-rank options differ, the rest agrees: the pair trains, replicas equal
    model = DDP(make_model())
    own = {"log_every": rank, "jsonl_path": str(Path(directory, f"log{rank}.jsonl")) if rank else None}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gradsift.register_comm_hook(model, "topk", ratio=0.1, optimizer=optimizer, **own)
    for step in range(3):
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    results["trained"] = flat_params(model)
    return results


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_with_different_settings_stop_at_registration_naming_the_setting(tmp_path: Path) -> None:
    results = run_workers(__file__, "worker", 2, directory=str(tmp_path), timeout=180)
    expected = {case: line for case, (_, _, line) in HOOK_PAIRS.items()}
    expected["DeMo chunk"] = "  chunk: 8 on rank 0; 16 on rank 1"
    expected["diloco sync_every"] = "  sync_every: 5 on rank 0; 10 on rank 1"
    expected["FSDP ratio"] = "  compressor option ratio: 0.01 on rank 0; 0.1 on rank 1"
    for case, line in expected.items():
        for rank, result in enumerate(results):
            error = result[case]["error"]
            assert error is not None, f"{case}: rank {rank} registered"
            assert line in error.splitlines(), f"{case}, rank {rank}:\n{error}"
            assert result[case]["seconds"] < 10, (case, rank, result[case]["seconds"])
        assert results[0][case]["error"] == results[1][case]["error"]  # the same text on every rank
    assert torch.equal(results[0]["trained"], results[1]["trained"])
    assert not torch.equal(results[0]["trained"], flat_params(make_model()))  # it did train
    assert (tmp_path / "log1.jsonl").is_file()


# -- in one process ----------------------------------------------------------------------------
def test_every_hook_option_but_the_per_rank_ones_is_compared() -> None:
    settings = hook_settings(GradsiftHookState.build("randomk", ratio=0.05, seed=3))
    fields = {field for field in HookOptions.__dataclass_fields__}
    assert fields - set(settings) == set(PER_RANK)
    assert settings["compressor"] == '"randomk"'
    assert settings["compressor option ratio"] == "0.05"
    assert settings["compressor option seed"] == "3"
    assert settings["exchange (resolved)"] == '"allreduce"'


def test_setting_text_is_canonical() -> None:
    assert setting_text(torch.bfloat16) == '"bfloat16"'
    assert setting_text(0.1) == "0.1" and setting_text(1e-3) == "0.001"
    assert setting_text((1, None, True)) == "[1, null, true]"
    assert setting_text({"b": 1, "a": Path("/x")}) == '{"a": "/x", "b": 1}'
    assert setting_text(object()) == '"<object>"'
    layer = torch.nn.Linear(3, 2)
    text = tensors_text(layer.parameters())
    assert text.startswith("2 tensors, 8 elements, layout ")
    assert text != tensors_text([layer.weight.t(), layer.bias])  # another shape, another layout


def test_a_disagreement_lists_each_setting_with_the_ranks_holding_each_value() -> None:
    ranks = [{"ratio": "0.1", "seed": "0"}] * 3 + [{"ratio": "0.01", "seed": "0"}] + [{"ratio": "0.1"}] * 2
    text = disagreement(ranks, "register_comm_hook")
    assert text.splitlines()[1:3] == [
        "  ratio: 0.1 on ranks 0-2, 4-5; 0.01 on rank 3",
        "  seed: 0 on ranks 0-3; (not set) on ranks 4-5",
    ]
    assert text.startswith(
        "the ranks disagree on settings that shape the messages or the result (register_comm_hook)"
    )
    assert "rank 1 sent settings that are not JSON" in disagreement(
        [{}, "rank 1 sent settings that are not JSON (x)"]
    )


@pytest.mark.distributed
def test_one_rank_agrees_with_itself(one_process_group: None) -> None:
    check_agreement({"a": "1"}, None, "test")
    assert issubclass(SettingsMismatchError, InvalidOptionError)
    assert gradsift.SettingsMismatchError is SettingsMismatchError
