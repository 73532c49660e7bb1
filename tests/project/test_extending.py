"""docs/extending.md's two examples: a compressor and an exchange of one's own, against oracles.

The examples (``examples/extending/``) train ``toy.STEPS`` steps of SGD on 2 gloo ranks.
Each test trains them on real ranks and replays the same training in the test process
from the methods' definitions, brute force, with no gradsift code:

* ``fraction-of-max`` with error feedback: per rank ``c = g + r``, the positions
  ``|c_i| >= alpha max_j |c_j|`` (a Python loop), cut to the ``k = max(1, floor(n ratio))``
  largest when more pass, ``r <- c - sent``; the update is the mean over ranks of what was
  sent.
* ``dense-sum`` carrying top-k: the same replay with the ``k`` largest ``|c_i|`` (a full
  sort); at ``ratio=1`` every element travels and the run must equal stock DDP's
  allreduce, trained in the same process group.

The page's Python blocks must be the example files, character for character, and the
``Example::`` blocks of the API docstrings (``register_comm_hook``,
``register_fsdp_comm_hook``, ``Compressor``, ``Exchange``) run as written, on 2 gloo ranks
where they need a process group, and do what they say.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
import textwrap
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
import toy  # examples/extending/toy.py: the examples' problem (model, batches, learning rate; no gradsift)
from torch.nn.parallel import DistributedDataParallel

from support import ROOT
from support.distributed import run_workers

EXTENDING = ROOT / "examples" / "extending"
PAGE = ROOT / "docs" / "extending.md"
#: A file's block on the page: its path in backticks on the line before the fence.
SHOWN_FILE = re.compile(r"^`(examples/extending/[\w.]+\.py)`:?\n+```python\n(.*?)^```", re.S | re.M)
ATOL = 1e-6  # float32 sums in another order; a selection that differs moves a weight by ~1e-3


Select = Callable[[list[float], int], list[int]]


# -- the page shows the files ---------------------------------------------------------------
def test_page_shows_every_example_file_exactly() -> None:
    text = PAGE.read_text(encoding="utf-8")
    shown = {path: body for path, body in SHOWN_FILE.findall(text)}
    files = {f"examples/extending/{p.name}" for p in EXTENDING.glob("*.py")}
    assert set(shown) == files
    for path, body in shown.items():
        assert body == (ROOT / path).read_text(encoding="utf-8"), f"{PAGE.name}'s block of {path} differs"


def test_page_is_linked_from_the_index_and_the_site_navigation() -> None:
    assert "(extending.md)" in (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    assert re.search(r"^\s+- .+: extending\.md$", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.M)


# -- the compressor on its own, in this process ---------------------------------------------
@pytest.fixture
def my_compressor(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """examples/extending/my_compressor.py imported; its registration undone afterwards."""
    from gradsift.compressors import registry

    monkeypatch.setattr(registry, "_TABLE", dict(registry._TABLE))
    spec = importlib.util.spec_from_file_location("my_compressor", EXTENDING / "my_compressor.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "my_compressor", module)
    spec.loader.exec_module(module)
    return module


def passing(values: list[float], fraction: float) -> list[int]:
    """``{i : |x_i| >= fraction max_j |x_j|}``, by a loop over the elements."""
    largest = max(abs(v) for v in values)
    return [i for i, v in enumerate(values) if abs(v) >= fraction * largest]


def largest(values: list[float], candidates: list[int], k: int) -> list[int]:
    """The ``k`` candidates of largest ``|x_i|`` (all of them when there are at most ``k``)."""
    return sorted(sorted(candidates, key=lambda i: -abs(values[i]))[:k])


@pytest.mark.parametrize("fraction", [0.2, 0.5, 1.0])
def test_fraction_of_max_selects_its_definition(my_compressor: ModuleType, fraction: float) -> None:
    import gradsift

    x = torch.randn(500, generator=torch.Generator().manual_seed(3))
    compressor = gradsift.get_compressor("fraction-of-max", fraction=fraction, ratio=0.05)
    values = x.tolist()
    expected = passing(values, fraction)
    payload = compressor.compress(x)  # the exact method: every passing element
    assert payload.indices is not None and payload.values is not None
    assert payload.indices.tolist() == expected
    assert torch.equal(payload.values, x[expected])
    assert torch.equal(
        compressor.decompress([payload, payload], x.numel()),
        torch.zeros(500).index_put((torch.tensor(expected),), x[expected]),
    )


def test_fraction_of_max_keeps_the_largest_within_its_room(my_compressor: ModuleType) -> None:
    from gradsift.core.readout import Readout

    x = torch.randn(500, generator=torch.Generator().manual_seed(4))
    compressor = my_compressor.FractionOfMax(fraction=0.2, ratio=0.05)
    k = compressor.capacity(500)
    assert k == 25
    values = x.tolist()
    over = passing(values, 0.2)
    assert len(over) > k  # the cut binds
    payload = compressor.encode(x, key=0, capacity=k, readout=Readout())
    used = payload.trimmed()
    assert used.indices is not None
    assert used.indices.tolist() == largest(values, over, k)


def test_fraction_of_max_checks_its_options_and_flags_nonfinite(my_compressor: ModuleType) -> None:
    import gradsift
    from gradsift.core.errors import InvalidOptionError, NonFiniteGradientError

    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(InvalidOptionError, match="fraction"):
            gradsift.get_compressor("fraction-of-max", fraction=bad)
    compressor = gradsift.get_compressor("fraction-of-max")
    for poison in (float("nan"), float("inf")):
        x = torch.randn(100)
        x[17] = poison
        with pytest.raises(NonFiniteGradientError):
            compressor.compress(x)


# -- both examples on 2 gloo ranks ------------------------------------------------------------
def trained_worker(rank: int, world: int) -> dict[str, list[torch.Tensor] | int | float]:
    """Train each example as it is written, and stock DDP, in this process group."""
    assert world == toy.WORLD
    import my_compressor
    import my_exchange

    out: dict[str, list[torch.Tensor] | int | float] = {}
    model, state, _ = my_compressor.train(rank)
    out["fraction-of-max"] = [p.detach().clone() for p in model.parameters()]
    out["fraction-of-max density"] = state.stats()["total"]["density"]
    for ratio in (0.1, 1.0):
        model, state, _ = my_exchange.train(rank, ratio=ratio)
        assert type(state.exchange).__name__ == "DenseSum"
        out[f"dense-sum {ratio}"] = [p.detach().clone() for p in model.parameters()]
        total = state.stats()["total"]
        out[f"dense-sum {ratio} bytes"] = total["bytes_sent"], total["dense_bytes"]
    stock = DistributedDataParallel(toy.make_model())
    toy.sgd(stock, rank)
    out["stock"] = [p.detach().clone() for p in stock.parameters()]
    return out


@pytest.fixture(scope="module")
def trained() -> list[dict]:
    return run_workers(__file__, "trained_worker", toy.WORLD, timeout=240)


def replay(select: Select, steps: int = toy.STEPS) -> tuple[list[torch.Tensor], int]:
    """SGD on ``toy``'s problem where each rank sends ``select(c, n)`` of its compensated
    gradient ``c = g + r`` (error feedback ``r <- c - sent``) and every rank applies the
    mean of what was sent; the final parameters, and the steps where some rank sent
    fewer than all ``n`` elements."""
    model = toy.make_model()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    residual = [torch.zeros(n) for _ in range(toy.WORLD)]
    compressed_steps = 0
    for step in range(steps):
        total = torch.zeros(n)
        short = False
        for rank in range(toy.WORLD):
            inputs, targets = toy.batch(rank, step)
            grads = torch.autograd.grad(torch.nn.functional.mse_loss(model(inputs), targets), params)
            compensated = torch.cat([g.reshape(-1) for g in grads]) + residual[rank]
            chosen = select(compensated.tolist(), n)
            short |= len(chosen) < n
            sent = torch.zeros(n)
            sent[chosen] = compensated[chosen]
            residual[rank] = compensated - sent
            total += sent
        compressed_steps += short
        mean = total / toy.WORLD
        with torch.no_grad():
            for p, piece in zip(params, mean.split([p.numel() for p in params]), strict=True):
                p -= toy.LR * piece.view_as(p)
    return [p.detach() for p in params], compressed_steps


def assert_params(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def far_from(got: list[torch.Tensor], other: list[torch.Tensor]) -> bool:
    return max((a - b).abs().max().item() for a, b in zip(got, other, strict=True)) > 100 * ATOL


def every(values: list[float], n: int) -> list[int]:
    return list(range(n))


@pytest.mark.slow
@pytest.mark.distributed
def test_my_compressor_trains_as_its_definition_says(trained: list[dict]) -> None:
    def fraction_of_max(values: list[float], n: int) -> list[int]:
        return largest(values, passing(values, 0.5), max(1, int(n * 0.1)))

    expected, compressed = replay(fraction_of_max)
    assert compressed == toy.STEPS
    dense, _ = replay(every)
    assert far_from(expected, dense)  # the compression shows in the result
    for rank in trained:
        assert_params(rank["fraction-of-max"], expected)
        assert 0 < rank["fraction-of-max density"] < 0.1


@pytest.mark.slow
@pytest.mark.distributed
def test_my_exchange_delivers_the_mean_of_what_was_sent(trained: list[dict]) -> None:
    def top_k(values: list[float], n: int) -> list[int]:
        return largest(values, list(range(n)), max(1, int(n * 0.1)))

    expected, compressed = replay(top_k)
    assert compressed == toy.STEPS
    dense, _ = replay(every)
    assert far_from(expected, dense)
    for rank in trained:
        assert_params(rank["dense-sum 0.1"], expected)
        sent, dense_bytes = rank["dense-sum 0.1 bytes"]
        assert sent == dense_bytes  # n float32 values a step: dense on the wire


@pytest.mark.slow
@pytest.mark.distributed
def test_my_exchange_of_everything_equals_stock_ddp(trained: list[dict]) -> None:
    for rank in trained:
        assert_params(rank["dense-sum 1.0"], rank["stock"])
    dense, _ = replay(every)
    assert_params(trained[0]["stock"], dense)  # the replay's own positive control


# -- the Example:: blocks of the API docstrings ----------------------------------------------
def example_block(documented: object) -> str:
    """The code of the ``Example...::`` block of ``documented``'s docstring, dedented."""
    doc = inspect.getdoc(documented)
    assert doc is not None
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Example") and line.endswith("::"))
    body = []
    for line in lines[start + 1 :]:
        if line.strip() and not line.startswith(" "):
            break
        body.append(line)
    return textwrap.dedent("\n".join(body)).strip("\n") + "\n"


def test_compressor_example_runs_and_means_what_it_says() -> None:
    import gradsift
    from gradsift.compressors.base import Compressor

    generator = torch.Generator().manual_seed(5)
    gradient, other = torch.randn(1000, generator=generator), torch.randn(1000, generator=generator)
    namespace = {
        "gradsift": gradsift,
        "gradient": gradient,
        "other_payload": gradsift.get_compressor("topk", ratio=0.01).compress(other),
    }
    exec(example_block(Compressor), namespace)
    top = sorted(range(1000), key=lambda i: -abs(gradient[i].item()))[:10]
    assert namespace["payload"].indices.tolist() == sorted(top)
    expected = torch.zeros(1000)
    expected[top] += gradient[top] / 2
    other_top = sorted(range(1000), key=lambda i: -abs(other[i].item()))[:10]
    expected[other_top] += other[other_top] / 2
    torch.testing.assert_close(namespace["mean"], expected, atol=1e-7, rtol=0)


def examples_worker(rank: int, world: int) -> dict[str, object]:
    """Each hook example run as written on fresh ``toy`` modules, then one training step.

    On this CPU-only group the FSDP2 mesh is on ``"cpu"`` (the docstring's ``"cuda"``), with
    one rank per node, FSDP1 gets ``device_id=cpu``, and ``Exchange``'s block gets its
    ``model``."""
    import functools

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, fully_shard

    import gradsift
    from gradsift.exchanges.base import Exchange
    from gradsift.frontends.ddp import register_comm_hook
    from gradsift.frontends.fsdp import register_fsdp_comm_hook

    fsdp1, fsdp2 = example_block(register_fsdp_comm_hook).split("\n\n")
    blocks = {
        "ddp": example_block(register_comm_hook),
        "fsdp1": fsdp1,
        "fsdp2": fsdp2.replace('"cuda"', '"cpu"'),
        "exchange": example_block(Exchange),
    }
    out: dict[str, object] = {}
    for name, code in blocks.items():
        module = toy.make_model()
        namespace = {
            "gradsift": gradsift,
            "torch": torch,
            "module": module,
            "optimizer": torch.optim.SGD(module.parameters(), lr=toy.LR, momentum=0.9),
            "FullyShardedDataParallel": functools.partial(
                FullyShardedDataParallel, device_id=torch.device("cpu")
            ),
            "ShardingStrategy": ShardingStrategy,
            "init_device_mesh": init_device_mesh,
            "fully_shard": fully_shard,
            "nodes": world,
            "gpus_per_node": 1,
        }
        if name == "exchange":  # its block starts from a DDP model
            namespace["model"] = DistributedDataParallel(module)
        exec(code, namespace)
        model = namespace.get("model", module)
        inputs, targets = toy.batch(rank, 0)
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        state = namespace["state"]
        out[name] = {
            "step": state.step,
            "density": state.stats()["step"]["density"],
            "exchange": repr(state.exchange),
        }
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_hook_examples_run_as_written() -> None:
    n = sum(p.numel() for p in toy.make_model().parameters())
    for rank in run_workers(__file__, "examples_worker", toy.WORLD, timeout=240):
        for name, out in rank.items():
            assert out["step"] == 1, name
            if name != "ddp":
                assert out["density"] == pytest.approx(max(1, int(0.01 * n)) / n), name  # topk at 1%
        assert rank["exchange"]["exchange"] == "Balanced()"
        # register_comm_hook's example is the one line, compressor="auto": under its SGD it measures
        # on sidco-exp at ratio 0.01 (its density is the data's, near the ratio)
        assert 0 < rank["ddp"]["density"] < 0.05 and rank["ddp"]["exchange"] != "Allreduce()"
