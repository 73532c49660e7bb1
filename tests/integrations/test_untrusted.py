"""Bytes from outside are never unpickled: a checkpoint file, or a peer's hook state, holding
an object whose ``__reduce__`` would run code is refused without running it, and every
compressor's hook state (DiLoCo's and DeMo's too) is plain data that round-trips through
``torch.load(weights_only=True)``.

The planted object pickles as ``os.mkdir(marker)``: whether the directory exists is the
oracle, and a control shows that plain ``pickle.loads`` of the same bytes does make it.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import UntrustedDataError
from gradsift.core.plain import check_plain, plain_bytes, read_plain
from gradsift.hook.checkpoint_checks import check_hook_entry
from gradsift.hook.handshake import hook_settings
from support.distributed import run_workers
from support.models import batch, make_model, same


class Planted:
    """Pickles as ``os.mkdir(marker)``: unpickling it makes the directory ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.marker,))


def test_the_planted_payload_runs_under_plain_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save({"hook": Planted(marker)}, buffer)
    torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)  # what transformers.py did
    assert marker.is_dir()
    os.rmdir(marker)
    pickle.loads(pickle.dumps(Planted(marker)))
    assert marker.is_dir()


def test_a_planted_checkpoint_file_is_refused_without_running(tmp_path: Path) -> None:
    marker, path = tmp_path / "ran", tmp_path / "gradsift_hook_state_0.pt"
    torch.save({"world_size": 1, "global_step": 3, "hook": {"store": Planted(marker)}}, path)
    with pytest.raises(UntrustedDataError, match=r"gradsift_hook_state_0\.pt refused.*GLOBAL posix\.mkdir"):
        read_plain(path, str(path))
    assert not marker.exists()


@pytest.mark.parametrize(
    "content", [b"", b"garbage", b"PK\x03\x04 not a zip"], ids=["empty", "garbage", "zip"]
)
def test_bytes_that_are_no_torch_file_are_refused_by_name(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "hook.pt"
    path.write_bytes(content)
    with pytest.raises(UntrustedDataError, match=r"hook\.pt refused: not a torch file of plain data"):
        read_plain(path, str(path))


def test_check_plain_names_the_entry_that_is_not_plain(tmp_path: Path) -> None:
    with pytest.raises(UntrustedDataError, match=r"state\['store'\]\[1\] is a .*Planted, not plain data"):
        check_plain({"step": 1, "store": [torch.ones(2), Planted(tmp_path / "x")]}, "state")
    with pytest.raises(UntrustedDataError, match=r"state key .*Planted"):
        check_plain({Planted(tmp_path / "x"): 1}, "state")
    value = {"a": [1, 2.5, None, "s", (torch.zeros(3, dtype=torch.int16), torch.float16)], 3: {"b": True}}
    assert same(read_plain(plain_bytes(value, "value"), "value"), value)
    assert not (tmp_path / "x").exists()


# -- two gloo ranks ---------------------------------------------------------------------------
def _every_state(rank: int) -> dict:
    """Per hook (every registry compressor, DiLoCo, DeMo) after 3 steps of 2 ranks: whether its
    state survives plain_bytes -> read_plain -> load_state_dict into a fresh one unchanged."""
    results = {}
    for name in gradsift.available_compressors():
        options = {"threshold": 1e-3} if name == "threshold" else {}

        def build(name: str = name, options: dict = options) -> tuple[DDP, object, torch.optim.Optimizer]:
            model = DDP(make_model())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            return model, gradsift.register_comm_hook(model, name, optimizer=optimizer, **options), optimizer

        model, state, optimizer = build()
        for step in range(3):
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        saved = state.state_dict()
        read = read_plain(plain_bytes(saved, name), name)
        _, fresh, _ = build()
        check_hook_entry(fresh, read, hook_settings(state), name)  # a genuine state passes the checks
        fresh.load_state_dict(read)
        results[name] = same(read, saved) and same(fresh.state_dict(), saved)

    model, demo_model = make_model(), make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = gradsift.diloco(model, optimizer, sync_every=2)  # an outer step every 2 of optimizer's
    demo = gradsift.DeMo(demo_model.parameters(), lr=0.01, chunk=4, topk=2)
    for step in range(4):
        x, y = batch(rank, step)
        for net, stepper in ((model, optimizer), (demo_model, demo)):
            torch.nn.functional.mse_loss(net(x), y).backward()
            stepper.step()
            stepper.zero_grad()
    assert diloco.rounds == 2 and demo.steps == 4
    for name, saved in (("diloco", diloco.state_dict()), ("demo", demo.state_dict())):
        results[name] = same(read_plain(plain_bytes(saved, name), name), saved)
    return results


def _gather_case(state, rank: int, directory: str, case: str) -> dict:
    """``gather_hook_states`` with rank 1 honest, holding a planted object, or hostile (it
    skips its own check and sends the planted bytes): what it returned or raised."""
    from gradsift.integrations import checkpoint

    marker = Path(directory, f"{case}-ran")
    original_state_dict, original_bytes = state.state_dict, checkpoint.plain_bytes
    if rank == 1 and case == "planted":
        state.state_dict = lambda: {**original_state_dict(), "extra": Planted(marker)}
    if rank == 1 and case == "hostile":

        def unchecked(value, where):  # a peer that does not run gradsift's check
            buffer = io.BytesIO()
            torch.save({**value, "extra": Planted(marker)}, buffer)
            return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)

        checkpoint.plain_bytes = unchecked
    try:
        outcome = {"gathered": checkpoint.gather_hook_states(state)}
    except UntrustedDataError as error:
        outcome = {"error": str(error)}
    finally:
        state.state_dict, checkpoint.plain_bytes = original_state_dict, original_bytes
    dist.barrier()
    outcome["ran"] = marker.exists()
    return outcome


def worker(rank: int, world: int, directory: str) -> dict:
    model = DDP(make_model())
    state = gradsift.register_comm_hook(model, "dgc", ratio=0.2)
    x, y = batch(rank, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    cases = {case: _gather_case(state, rank, directory, case) for case in ("honest", "planted", "hostile")}
    return {"own": state.state_dict(), "cases": cases, "round_trips": _every_state(rank)}


@pytest.mark.slow
@pytest.mark.distributed
def test_peers_states_travel_as_plain_data_and_a_planted_one_is_refused(tmp_path: Path) -> None:
    results = run_workers(__file__, "worker", 2, directory=str(tmp_path), timeout=240)
    honest = [r["cases"]["honest"] for r in results]
    assert honest[1]["gathered"] is None
    gathered = honest[0]["gathered"]
    assert gathered["world_size"] == 2
    assert all(same(gathered["ranks"][r], results[r]["own"]) for r in range(2))
    assert not same(gathered["ranks"][0]["store"], gathered["ranks"][1]["store"])  # two ranks' residuals

    # rank 1's own state holds the object: every rank raises, naming rank 1 and the entry
    planted = [r["cases"]["planted"] for r in results]
    assert "rank 1's hook state['extra'] is a" in planted[1]["error"]
    assert "hook state of rank(s) [1] is not plain data" in planted[0]["error"]
    # a peer that skips the check: rank 0 refuses its bytes without building them
    hostile = [r["cases"]["hostile"] for r in results]
    assert hostile[1] == {"gathered": None, "ran": False}
    assert "rank 1's hook state refused" in hostile[0]["error"]
    assert "GLOBAL posix.mkdir" in hostile[0]["error"]
    assert not any(r["cases"][case]["ran"] for r in results for case in ("planted", "hostile"))

    for rank, result in enumerate(results):
        assert result["round_trips"] == dict.fromkeys(
            [*gradsift.available_compressors(), "diloco", "demo"], True
        ), rank
