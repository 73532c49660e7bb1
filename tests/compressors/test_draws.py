"""Counter-based draws: the same numbers on every device, and the right distributions.

The oracle for the numbers is the hash written out in plain Python integers (the formula
of :mod:`gradsift.compressors.draws`' docstring, not its code); the second device is
PyTorch's lazy-tensor backend (a real non-CPU backend on this CPU-only machine, see
``support/lazy_device.py``), which runs the same integer kernels through another
implementation. Random-k's positions, DGC's sample and CocktailSGD's subsets follow.
"""

import pytest
import torch
from scipy import stats

import gradsift
from gradsift.compressors import draws
from gradsift.compressors.randomk import sample_without_replacement
from support.lazy_device import lazy_device, needs_lazy

MASK = 0xFFFFFFFF


def lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK
    return x ^ (x >> 16)


def word(key: int, counter: int) -> int:
    low, high = key & MASK, (key >> 32) & MASK
    return lowbias32(lowbias32(counter ^ low) ^ high)


def below(n: int, key: int, counter: int) -> int:
    second_key = ((((key >> 32) & MASK) ^ 0x9E3779B9) << 32) | ((key & MASK) ^ 0x9E3779B9)
    return (((word(key, counter) & 0x7FFFFFFF) << 32) | word(second_key, counter)) % n


@pytest.mark.parametrize("key", [0, 1, 0x0123456789ABCDEF, (1 << 63) - 1])
def test_words_are_the_hash_written_in_python_integers(key):
    got = draws.words(key, 300, torch.device("cpu"), start=MASK - 150).tolist()
    assert got == [word(key, (MASK - 150 + i) & MASK) for i in range(300)]
    n = 1_000_003
    assert draws.below(n, key, 200, torch.device("cpu")).tolist() == [below(n, key, i) for i in range(200)]


@pytest.fixture(scope="module")
def device() -> torch.device:
    """The lazy-tensor device (its backend starts once per process)."""
    needs_lazy()
    return lazy_device()


def test_the_draws_are_the_same_on_another_device(device):
    key = draws.stream_seed(5, "bucket0", 3)
    for make in (
        lambda d: draws.below(7919, key, 5000, d),
        lambda d: draws.permutation(3000, key, d),
        lambda d: sample_without_replacement(100_000, 1000, key, d),
        lambda d: sample_without_replacement(1000, 700, key, d),  # k > n/2: the permutation
    ):
        assert torch.equal(make(torch.device("cpu")), make(device).cpu())


def test_below_is_uniform_and_the_permutation_a_permutation():
    values = draws.below(10, 42, 100_000, torch.device("cpu"))
    counts = torch.bincount(values, minlength=10).double()
    assert stats.chisquare(counts.numpy()).pvalue > 1e-3
    order = draws.permutation(5000, 42, torch.device("cpu"))
    assert torch.equal(torch.sort(order).values, torch.arange(5000))
    # a random permutation leaves about one element in place, not a sorted run
    assert int((order == torch.arange(5000)).sum()) < 10


def test_random_k_samples_every_position_alike_without_repeats():
    n, k, trials = 200, 20, 2000
    hits = torch.zeros(n)
    for trial in range(trials):
        drawn = sample_without_replacement(n, k, draws.stream_seed(0, "x", trial), torch.device("cpu"))
        assert drawn.unique().numel() == k
        hits[drawn] += 1
    expected = trials * k / n
    assert stats.chisquare(hits.numpy(), [expected] * n).pvalue > 1e-3


@pytest.mark.parametrize("name", ["randomk", "dgc", "cocktail"])
def test_random_k_dgc_and_cocktail_draw_the_same_on_another_device(device, name):
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    options = {} if name == "cocktail" else {"ratio": 0.01}
    on_cpu, elsewhere = (gradsift.get_compressor(name, **options) for _ in range(2))
    for _ in range(3):
        assert torch.equal(on_cpu.compress(x).indices, elsewhere.compress(x.to(device)).indices.cpu())


def test_dgc_sample_follows_its_calls_and_round_trips_them():
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(1))
    first = gradsift.get_compressor("dgc", ratio=0.01)
    runs = [first.compress(x, key="k").indices for _ in range(3)]
    state = first.state_dict()
    assert state == {"calls": {"k": 3}}
    resumed = gradsift.get_compressor("dgc", ratio=0.01)
    resumed.load_state_dict(state)
    fresh = gradsift.get_compressor("dgc", ratio=0.01)
    again = [fresh.compress(x, key="k").indices for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(runs, again[:3], strict=True))
    assert torch.equal(resumed.compress(x, key="k").indices, again[3])
