"""Every registry compressor keeps its input's device and the documented dtypes.

On CPU the device cannot be wrong by accident, so the compressors run under
``torch.device("meta")`` as the *default* device: a tensor created without
``device=`` (a hidden CPU tensor on a GPU run) then lands on ``meta`` and either
fails to combine with the input or shows up in the payload, and the payload values
are compared with the input outside that context (an index tensor on ``meta`` reads
garbage instead of failing). The CUDA case runs the same checks on a GPU.
"""

import pytest
import torch

import gradsift
from gradsift.compressors import Payload, Sparsifier
from gradsift.compressors.kernels import SELECTION_CHUNK
from gradsift.tools.benchmarking import density_option

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: powersgd has no flat-tensor compress (it wraps PyTorch's DDP hook; see docs/quantizers.md).
NAMES = [name for name in gradsift.available_compressors() if name != "powersgd"]
#: Sizes: below SIDCo's exact_below, and past two CPU selection chunks (the chunked pass).
SIZES = [1000, 2 * SELECTION_CHUNK + 4321]

#: Documented wire dtypes of the ratio-less payload fields, for fp16/bf16/fp32 gradients.
QUANTIZED = {
    "qsgd": torch.uint8,
    "terngrad": torch.uint8,
    "signsgd": torch.uint8,
    "efsignsgd": torch.uint8,
    "onebit": torch.uint8,
    "blockquant": torch.uint8,
}
CAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


def build(name: str):
    option = density_option(name)
    return gradsift.get_compressor(
        name, **({} if option is None else {option: 0.01 if option == "ratio" else 2.0})
    )


def compress(compressor, x: torch.Tensor) -> Payload:
    if compressor.name == "vgc":
        return compressor.compress(x, variance=x.abs().float())
    return compressor.compress(x)


def gradient(numel: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(numel)
    return (
        torch.empty(numel)
        .exponential_(generator=generator)
        .mul_(torch.randn(numel, generator=generator))
        .to(device, dtype)
    )


def check_device_and_dtypes(name: str, numel: int, dtype: torch.dtype, device: str) -> None:
    """Payload fields, decompressed mean and sent tensor on ``x``'s device, in the documented dtypes."""
    x = gradient(numel, dtype, device)
    compressor = build(name)
    with torch.device("meta"):
        for _ in range(3):  # adaptive methods reach their steady path
            payload = compress(compressor, x)
        mean = compressor.decompress([payload, payload], numel)
        sent = compressor.sent_dense(payload)
    tensors = {**payload.fields(), "indices": payload.indices, "mean": mean, "sent": sent}
    for field, tensor in tensors.items():
        if tensor is not None:
            assert tensor.device == x.device, f"{name}: {field} on {tensor.device}"
    assert payload.dtype == dtype and mean.dtype == dtype and sent.dtype == dtype
    assert mean.shape == sent.shape == (numel,)
    if name == "cocktail":  # positions and quantized values
        assert payload.indices.dtype == torch.int64 and payload.codes.dtype == torch.uint8
        assert payload.scales.dtype == torch.float32
        outside = torch.ones(numel, dtype=torch.bool, device=x.device)
        outside[payload.indices] = False
        assert not sent[outside].any()  # nothing but the selected positions
    elif isinstance(compressor, Sparsifier):
        assert payload.indices.dtype == torch.int64 and payload.values.dtype == dtype
        assert torch.equal(payload.values, x[payload.indices])
        assert torch.equal(sent[payload.indices], payload.values)
    elif name in QUANTIZED:
        assert payload.codes.dtype == QUANTIZED[name] and payload.scales.dtype == torch.float32
    elif name == "vgc":
        assert payload.codes.dtype == torch.int32 and payload.scales.dtype == torch.float32
    else:  # dense: none keeps the dtype, the casts send theirs
        assert payload.values.dtype == CAST.get(name, dtype)
    assert torch.equal(mean, sent)  # the mean of two identical payloads is the payload


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_cpu_payloads_and_results_keep_device_and_documented_dtypes(name, numel, dtype):
    check_device_and_dtypes(name, numel, dtype, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_payloads_and_results_keep_device_and_documented_dtypes():
    for name in NAMES:
        for numel in SIZES:
            for dtype in DTYPES:
                check_device_and_dtypes(name, numel, dtype, "cuda")


def test_the_meta_guard_catches_a_tensor_made_without_device():
    """The harness above is only as good as this: a factory call without device= is caught."""

    class HiddenDefaultDevice(gradsift.compressors.topk.TopK):
        def select(self, flat, key, capacity, readout):
            chosen = super().select(flat, key, capacity, readout)
            return chosen._replace(indices=chosen.indices + torch.zeros((), dtype=torch.int64))

    x = gradient(1000, torch.float32, "cpu")
    with torch.device("meta"), pytest.raises(RuntimeError, match="meta"):
        HiddenDefaultDevice(ratio=0.01).compress(x)
