"""PowerSGD: options, the hook-only contract, and 2 real gloo ranks against PyTorch's own hook."""

import copy
import io
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import gradsift
from gradsift.compressors.powersgd import DENSE_AFTER_LOAD
from gradsift.core.errors import InvalidOptionError

WORLD = 2
STEPS = 8
START = 3


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rank": 0}, "rank must lie in"),
        ({"start_iter": 1}, "start_iter must lie in \\[2"),
        ({"min_compression_rate": 0.0}, "min_compression_rate must lie in"),
        ({"min_compression_rate": float("nan")}, "min_compression_rate must be a number"),
        ({"orthogonalization_epsilon": -1e-8}, "orthogonalization_epsilon must lie in"),
        ({"warm_start": 1}, "warm_start must be True or False"),
        ({"seed": -3}, "seed must lie in"),
        ({"ratio": 0.1}, "no option.*ratio.*rank"),
    ],
)
def test_bad_options_name_the_argument(options, message):
    with pytest.raises(ValueError, match=message):
        gradsift.get_compressor("powersgd", **options)


def test_start_iter_may_be_zero_without_error_feedback_and_warm_start():
    compressor = gradsift.get_compressor("powersgd", start_iter=0, use_error_feedback=False, warm_start=False)
    assert compressor.options()["start_iter"] == 0
    assert compressor.exchanges == ("delegated",) and not compressor.error_feedback


def test_single_tensor_use_points_to_the_comm_hook():
    compressor = gradsift.get_compressor("powersgd")
    with pytest.raises(ValueError, match="register_comm_hook"):
        compressor.compress(torch.randn(4, 4))
    with pytest.raises(ValueError, match="register_comm_hook"):
        compressor.decompress([], 16)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Weight 16x32 is compressed at rank 1 ((16+32)*2 < 512); the 16-element bias is not.
    return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1, bias=False))


def _train(ddp: DistributedDataParallel, rank: int, steps: range, record=None) -> None:
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        inputs = torch.randn(8, 32, generator=gen)
        optimizer.zero_grad()
        ddp(inputs).square().mean().backward()
        optimizer.step()
        if record is not None:
            record(step)


def _hooked(model: torch.nn.Module, **options) -> tuple[DistributedDataParallel, object]:
    # One bucket holding every parameter, so the bucket index (0) is stable.
    ddp = DistributedDataParallel(model, bucket_cap_mb=25)
    return ddp, gradsift.register_comm_hook(ddp, "powersgd", rank=1, start_iter=START, **options)


def _checkpoint_roundtrip(state: dict) -> dict:
    saved = io.BytesIO()
    torch.save(state, saved)
    saved.seek(0)
    return torch.load(saved, weights_only=True)


def powersgd_worker(rank: int, world_size: int) -> dict:
    """Worker (run by ``run_workers``): gradsift's hook, PyTorch's hook, a resume, a refused checkpoint."""
    ours, state = _hooked(_model())
    nbytes, checkpoint = [], {}

    def record(step):
        nbytes.append(state.stats()["step"]["bytes_sent"])
        if step == STEPS - 1 - STEPS // 2:
            checkpoint["model"] = copy.deepcopy(ours.module.state_dict())
            checkpoint["hook"] = _checkpoint_roundtrip(state.state_dict())
            # The uninterrupted run takes the same dense step after a load as a resumed one.
            state.load_state_dict(state.state_dict())

    _train(ours, rank, range(STEPS), record)

    reference = DistributedDataParallel(_model(), bucket_cap_mb=25)
    reference.register_comm_hook(
        PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=START), powerSGD_hook
    )
    _train(reference, rank, range(STEPS - STEPS // 2))
    baseline, _ = _hooked(_model())
    _train(baseline, rank, range(STEPS - STEPS // 2))

    resumed_model = _model()
    resumed_model.load_state_dict(checkpoint["model"])
    resumed, resumed_state = _hooked(resumed_model)
    resumed_state.load_state_dict(checkpoint["hook"])
    resumed_nbytes = []
    _train(
        resumed,
        rank,
        range(STEPS - STEPS // 2, STEPS),
        lambda step: resumed_nbytes.append(resumed_state.stats()["step"]["bytes_sent"]),
    )

    # A checkpoint loaded into a model whose bucket holds other shapes is refused (once the
    # dense steps a load allows while DDP lays its buckets out are over).
    wider = torch.nn.Sequential(torch.nn.Linear(32, 17), torch.nn.Tanh(), torch.nn.Linear(17, 1, bias=False))
    mismatched, mismatched_state = _hooked(wider, error_feedback=False)
    mismatched_state.compressor.load_state_dict(checkpoint["hook"]["compressor"])
    try:
        _train(mismatched, rank, range(DENSE_AFTER_LOAD + 1))
        refusal = ""
    except Exception as error:  # DDP re-raises the hook's error from backward()
        refusal = str(error)

    return {
        "ours": [p.detach().clone() for p in ours.parameters()],
        "reference": [p.detach().clone() for p in reference.parameters()],
        "baseline": [p.detach().clone() for p in baseline.parameters()],
        "resumed": [p.detach().clone() for p in resumed.parameters()],
        "nbytes": nbytes,
        "resumed_nbytes": resumed_nbytes,
        "state": state.compressor.state_dict(),
        "residual_keys": list(state.store.table("residual")),
        "refusal": refusal,
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_two_gloo_ranks_match_pytorch_hook_and_resume():
    from support.distributed import run_workers

    results = run_workers(Path(__file__), "powersgd_worker", WORLD, timeout=120)
    dense, compressed = (32 * 16 + 16 + 16) * 4, (16 + 32 + 16 + 16) * 4
    for result in results:
        # PyTorch's algorithm, with its error feedback in gradsift's store: bit-identical
        # parameters to PyTorch's own hook.
        for ours, reference in zip(result["baseline"], result["reference"], strict=True):
            assert torch.equal(ours, reference)
        # A checkpoint taken mid-run resumes, in a fresh DDP model, to the same parameters.
        for ours, resumed in zip(result["ours"], result["resumed"], strict=True):
            assert torch.equal(ours, resumed)
        # Full bucket (528 fp32) while allreducing; then P (16) + Q (32) + bias (16) + last
        # layer (16, not worth compressing); the step after a load is dense again.
        assert result["nbytes"] == [dense] * START + [compressed] + [dense] + [compressed] * (
            STEPS - START - 2
        )
        assert result["resumed_nbytes"] == [dense] + [compressed] * (STEPS // 2 - 1)
        assert result["state"]["iter"] == STEPS
        assert result["state"]["error_dict"] == {}  # the error lives in gradsift's store:
        assert result["residual_keys"] == [(0, 1, 2)]  # one bucket, keyed by its parameters
        assert result["state"]["layouts"] == {0: [[1, 16], [16], [16, 32]]}
        assert "bucket 0 holds parameters of shapes [[1, 17], [17], [17, 32]]" in result["refusal"]
    # Every rank holds the same parameters.
    for ours, other in zip(results[0]["ours"], results[1]["ours"], strict=True):
        assert torch.equal(ours, other)


def static_graph_worker(rank: int, world_size: int) -> dict:
    """A resume under ``DDP(static_graph=True)``, which rebuilds its buckets a step later."""
    layers = [
        torch.nn.Linear(32, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 1),
    ]

    def hooked(seed: int) -> tuple[DistributedDataParallel, object]:
        torch.manual_seed(seed)
        ddp = DistributedDataParallel(torch.nn.Sequential(*copy.deepcopy(layers)), bucket_cap_mb=0.002,
                                      static_graph=True)  # fmt: skip
        return ddp, gradsift.register_comm_hook(ddp, "powersgd", rank=1, start_iter=2, warm_start=True)

    ddp, state = hooked(0)
    _train(ddp, rank, range(4))
    saved = {
        "model": copy.deepcopy(ddp.module.state_dict()),
        "hook": _checkpoint_roundtrip(state.state_dict()),
    }
    resumed, resumed_state = hooked(1)
    resumed.module.load_state_dict(saved["model"])
    resumed_state.load_state_dict(saved["hook"])
    compressed = []
    _train(
        resumed,
        rank,
        range(4, 8),
        lambda step: compressed.append(resumed_state.stats()["step"]["compressed_tensors"]),
    )
    return {
        "compressed": compressed,
        "params": torch.cat([p.detach().flatten() for p in resumed.parameters()]),
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_a_resume_under_static_graph_waits_for_the_rebuilt_buckets():
    """``static_graph=True`` hands the resumed run its first bucketing for two steps: both run
    dense (the memories belong to the rebuilt buckets), then PowerSGD compresses again; the
    second step had refused the layout before."""
    from support.distributed import run_workers

    results = run_workers(Path(__file__), "static_graph_worker", WORLD, timeout=120)
    for result in results:
        assert result["compressed"][:DENSE_AFTER_LOAD] == [0] * DENSE_AFTER_LOAD
        assert all(count > 0 for count in result["compressed"][DENSE_AFTER_LOAD:]), result["compressed"]
    assert torch.equal(results[0]["params"], results[1]["params"])


# -- the default epsilon (an unused layer's zero matrix: tests/hook/test_unused_parameters.py) --
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_default_epsilon_zeroes_a_zero_column_and_leaves_other_norms_alone(dtype):
    from gradsift.compressors.powersgd import negligible_epsilon

    epsilon = negligible_epsilon(dtype)
    zero = torch.zeros(5, dtype=dtype)
    assert torch.equal(zero / (torch.linalg.vector_norm(zero) + epsilon), zero)  # 0/0 would be NaN
    # Norms from the docstring's bound up to large ones, in the dtype: adding epsilon rounds back.
    bound = 4 * epsilon / torch.finfo(dtype).eps
    norms = (bound * torch.logspace(0, 12, 200, base=2, dtype=torch.float64)).to(dtype)
    norms = torch.cat([norms, torch.tensor([1e-3, 1.0, 100.0], dtype=dtype)])
    assert torch.equal(norms + epsilon, norms)
    assert epsilon > 0 and epsilon >= torch.finfo(torch.float32).tiny  # never flushed in fp32


def _memories_after_compressed_steps(model: torch.nn.Module, **options) -> tuple[dict, object]:
    """The hook's PowerSGD memories (PyTorch's own ``P``/``Q`` tensors) after steps past ``start_iter``."""
    ddp = DistributedDataParallel(model, bucket_cap_mb=25)
    hook = gradsift.register_comm_hook(ddp, "powersgd", start_iter=2, **options)
    _train(ddp, 0, range(4))
    return hook.state_dict()["compressor"], hook


@pytest.mark.parametrize("options", [{"rank": 1}, {"rank": 4}, {"rank": 3, "min_compression_rate": 1.0}])
def test_memory_sizes_are_what_pytorchs_hook_allocates(one_process_group, options):
    """Oracle: the sizes of the memories PyTorch's hook itself allocated for the bucket."""
    from gradsift.compressors.powersgd import memory_numels

    torch.manual_seed(0)
    conv = torch.nn.Sequential(  # a 4-D weight, viewed as 8 x 18
        torch.nn.Unflatten(1, (2, 4, 4)), torch.nn.Conv2d(2, 8, 3), torch.nn.Flatten(), torch.nn.Linear(32, 1)
    )
    for model in (_model(), conv):
        state, hook = _memories_after_compressed_steps(model, **options)
        ((index, layout),) = state["layouts"].items()
        made = memory_numels(
            layout, hook.compressor.rank, hook.compressor.min_compression_rate, hook.compressor.batched
        )
        assert made == (state["p_memory_dict"][index].numel(), state["q_memory_dict"][index].numel())


def test_a_checkpoint_of_another_rank_is_refused_naming_it(one_process_group):
    """A checkpoint made at rank 1 (the default before it became 8) into rank 4: refused before
    anything loads, naming the options; at rank 1 it loads and trains on."""
    state, _ = _memories_after_compressed_steps(_model(), rank=1)
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=25)
    hook = gradsift.register_comm_hook(ddp, "powersgd", rank=4, start_iter=2)
    # the 16 x 32 weight: at rank 1 P 16 + Q 32; at rank 4 (48 * 4 * 2 = 384 < 512) 64 + 128
    with pytest.raises(InvalidOptionError, match=r"holds 16 \+ 32 elements.*rank=4.*would make 64 \+ 128"):
        hook.compressor.load_state_dict(_checkpoint_roundtrip(state))
    assert hook.compressor.state.p_memory_dict == {}  # nothing loaded
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=25)
    hook = gradsift.register_comm_hook(ddp, "powersgd", rank=1, start_iter=2)
    hook.compressor.load_state_dict(_checkpoint_roundtrip(state))
    _train(ddp, 0, range(2))


def test_batched_memory_is_the_buckets_square_side_times_the_rank():
    from gradsift.compressors.powersgd import memory_numels

    # 32 x 16 + 16 = 528 elements: a 23 x 23 square (529 >= 528 > 484); P and Q are 23 x rank
    assert memory_numels([[32, 16], [16]], 2, 2.0, batched=True) == (46, 46)
    assert memory_numels([[24, 24]], 1, 2.0, batched=True) == (24, 24)  # 576 = 24^2 exactly


def test_batched_is_refused_where_pytorchs_batched_hook_cannot_run(one_process_group):
    """PyTorch's batched hook hands its batched orthogonalization one 2-D matrix (an assertion
    at the first compressed step in the versions that batch it): refused up front, naming the
    per-layer hook; where it runs, it trains past its first compressed step."""
    from gradsift.compressors.pytorch_hooks import batched_hook_runs

    if not batched_hook_runs():
        with pytest.raises(
            InvalidOptionError, match=r"batched=True: PyTorch's batched_powerSGD_hook .*batched=False"
        ):
            gradsift.get_compressor("powersgd", batched=True)
        return
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=25)
    gradsift.register_comm_hook(ddp, "powersgd", start_iter=2, batched=True)
    _train(ddp, 0, range(4))
