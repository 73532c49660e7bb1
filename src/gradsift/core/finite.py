"""The one non-finite check of a step's tensors: a NaN or Inf anywhere, as a device flag.

Every compressor and exchange asks the same question of what it sends or receives -- does
this tensor hold a NaN or an Inf? -- and answers it here, the same way: one sum per tensor,
accumulated in float64, and ``~isfinite`` of the sums. NaN and Inf propagate through a sum
(``Inf - Inf`` is NaN), and in float64 finite fp16, bf16 or fp32 values cannot overflow: for
``n < 2^53`` elements ``|sum| <= n * 3.4e38 < 1.8e308``. A sum in the input's own dtype
could (fp16's 65504 is reached by two elements of 40000), flagging a good step. PyTorch
widens a tensor to the sum's dtype before it reduces, so a tensor of more than :data:`CHUNK`
elements is summed in float64 partial sums of that many, then their sum: the widened copy is
a chunk's, never the whole tensor's. The flag stays on the device: nothing is read on the
host (the step's readout reads it once).

What a dropped step writes is decided here too (:func:`fill_where`): on a GPU by the device
flag itself, in CPU memory -- where reading the flag waits for no device -- by its value
(:func:`host_value`), so a kept step costs no pass over the tensor.
"""

from __future__ import annotations

import torch

#: Elements per float64 partial sum (the widened copy a sum makes is this many elements at most).
CHUNK = 1 << 20


def nonfinite(*tensors: torch.Tensor) -> torch.Tensor:
    """0-d bool on the tensors' device: some element of ``tensors`` is NaN or +-Inf."""
    flags = []
    for tensor in tensors:
        if tensor.numel() <= CHUNK:
            total = tensor.sum(dtype=torch.float64)
        else:  # partial sums of at most CHUNK elements, then their sum
            chunks = tensor.reshape(-1).split(CHUNK)
            total = torch.stack([chunk.sum(dtype=torch.float64) for chunk in chunks]).sum()
        flags.append(~torch.isfinite(total))
    return flags[0] if len(flags) == 1 else torch.stack(flags).any()


def host_value(flag: torch.Tensor) -> bool | None:
    """The 0-d bool ``flag``'s value when it lies in CPU memory (read through NumPy: there is
    no device to wait for, as in the compressors' CPU kernels), None on a device, where it
    stays."""
    return bool(flag.numpy()) if flag.device.type == "cpu" else None


def fill_where(tensor: torch.Tensor, flag: torch.Tensor, value: float) -> None:
    """``tensor <- value`` everywhere when the 0-d bool ``flag`` holds, in place: a
    ``masked_fill_`` on the device flag (no host read), or, for a flag in CPU memory, a
    ``fill_`` only when it holds (a tensor it spares is not read)."""
    held = host_value(flag)
    if held is None:
        tensor.masked_fill_(flag, value)
    elif held:
        tensor.fill_(value)
