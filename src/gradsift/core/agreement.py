"""Ranks that must agree: every rank's settings compared in one small collective.

A frontend describes the settings that shape its messages or its result as ``name -> text``
(:func:`setting_text` writes a value), and :func:`check_agreement` compares them, with
gradsift's version, across the group before the first step:

1. every rank all-gathers a fixed-size ``int64`` vector: the SHA-256 digest of its settings
   (canonical JSON) and the length of that JSON; equal digests end the check (one collective);
2. otherwise every rank all-gathers every rank's JSON, padded to the longest length (which
   step 1 told every rank), decodes it as JSON -- never unpickled -- and raises
   :class:`~gradsift.core.errors.SettingsMismatchError` naming each setting that differs and
   the ranks' values. Every rank takes the same branch, from the same gathered digests, so no
   rank waits for a collective the others skip.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from gradsift.core.collectives import blocking, collective_device
from gradsift.core.errors import SettingsMismatchError

#: The longest settings JSON a rank may announce (a corrupt length is refused, not allocated).
MAX_SETTINGS_BYTES = 1 << 16
#: Shown for a setting one rank has and another lacks.
UNSET = "(not set)"
#: The digest's ``int64`` words (SHA-256: 32 bytes).
DIGEST_WORDS = 4


def gradsift_version() -> str:
    """``gradsift.__version__``, read from the package object: Python imports a package before
    any of its modules, and an import of the facade from ``core`` would close a cycle through
    the frontends it imports."""
    return str(getattr(sys.modules["gradsift"], "__version__", "unknown"))


def setting_text(value: Any) -> str:
    """The canonical text of one setting's value: numbers, strings, booleans and None as
    JSON writes them (floats exactly), dtypes by name (``"float16"``), paths as strings,
    lists/tuples/dicts of those, and any other object by its type's name."""
    return json.dumps(_plain(value), sort_keys=True)


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    return f"<{type(value).__qualname__}>"


def tensors_text(tensors: Iterable[torch.Tensor]) -> str:
    """What a message laid out over ``tensors`` depends on, in a short text: their count,
    total elements and a digest of their shapes and dtypes in order."""
    tensors = list(tensors)
    layout = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors)
    digest = hashlib.sha256(layout.encode()).hexdigest()[:16]
    return f"{len(tensors)} tensors, {sum(t.numel() for t in tensors)} elements, layout {digest}"


def check_agreement(settings: Mapping[str, str], group: Any = None, where: str = "") -> None:
    """Collective: return when every rank of ``group`` holds the same ``settings``; else raise
    :class:`SettingsMismatchError` on every rank, naming each setting that differs and every
    rank's value (``where`` says what was being set up). gradsift's version is always one of
    the settings compared."""
    settings = {"gradsift version": setting_text(gradsift_version()), **settings}
    encoded = json.dumps(settings, sort_keys=True).encode()
    device = collective_device(group)
    world = dist.get_world_size(group)
    digest = torch.frombuffer(bytearray(hashlib.sha256(encoded).digest()), dtype=torch.int64)
    local = torch.cat([digest, torch.tensor([len(encoded)], dtype=torch.int64)]).to(device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    blocking(
        "settings all_gather", group, lambda: dist.all_gather(gathered, local, group=group, async_op=True)
    )
    rows = torch.stack(gathered).cpu()
    if bool((rows == rows[0]).all()):
        return
    lengths = [int(n) for n in rows[:, DIGEST_WORDS].tolist()]
    wrong = [f"rank {r}: {n}" for r, n in enumerate(lengths) if not 0 < n <= MAX_SETTINGS_BYTES]
    if wrong:
        raise SettingsMismatchError(
            f"the ranks' settings differ{_at(where)}, and some rank announced an impossible length for "
            f"them ({', '.join(wrong)}; at most {MAX_SETTINGS_BYTES} bytes): is every rank running "
            "the same gradsift?"
        )
    everyone = _all_gather_texts(encoded, max(lengths), lengths, group, device)
    raise SettingsMismatchError(disagreement(everyone, where))


def _all_gather_texts(
    encoded: bytes, longest: int, lengths: list[int], group: Any, device: torch.device
) -> list[dict[str, str] | str]:
    """Collective: every rank's settings JSON (padded to ``longest``), decoded; a rank whose
    bytes are not a JSON object of strings is its error's text instead."""
    local = torch.zeros(longest, dtype=torch.uint8)
    local[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    local = local.to(device)
    gathered = [torch.empty_like(local) for _ in range(len(lengths))]
    blocking(
        "settings texts all_gather",
        group,
        lambda: dist.all_gather(gathered, local, group=group, async_op=True),
    )
    texts: list[dict[str, str] | str] = []
    for rank, (row, length) in enumerate(zip(gathered, lengths, strict=True)):
        raw = row[:length].cpu().numpy().tobytes()
        try:
            value = json.loads(raw.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            texts.append(f"rank {rank} sent settings that are not JSON ({error})")
            continue
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            texts.append(f"rank {rank} sent settings that are not a JSON object of strings")
            continue
        texts.append(value)
    return texts


def disagreement(everyone: list[dict[str, str] | str], where: str = "") -> str:
    """The error text for ranks' settings ``everyone`` (rank order) that differ: each setting
    whose values differ, with the ranks holding each value."""
    broken = [entry for entry in everyone if isinstance(entry, str)]
    if broken:
        return f"the ranks' settings differ{_at(where)}: " + "; ".join(broken)
    settings = [entry for entry in everyone if isinstance(entry, dict)]
    names = sorted({name for entry in settings for name in entry})
    lines = []
    for name in names:
        holders: dict[str, list[int]] = {}
        for rank, entry in enumerate(settings):
            holders.setdefault(entry.get(name, UNSET), []).append(rank)
        if len(holders) > 1:
            values = "; ".join(f"{value} on {_ranks(ranks)}" for value, ranks in holders.items())
            lines.append(f"  {name}: {values}")
    return (
        f"the ranks disagree on settings that shape the messages or the result{_at(where)}:\n"
        + "\n".join(lines)
        + "\nevery rank must be given the same settings (under torchrun each node builds them "
        "from its own command line)"
    )


def _at(where: str) -> str:
    return f" ({where})" if where else ""


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` / ``ranks 0-2, 5``."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
