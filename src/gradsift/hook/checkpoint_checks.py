"""What a hook state read from a checkpoint must be before it is loaded.

:meth:`GradsiftHookState.load_state_dict` trusts its input: a NaN residual made every later
step roll back, a negative step or capacity failed at the first step, a checkpoint of
another compressor raised a ``KeyError`` there. :func:`check_hook_entry` refuses such an
entry with :class:`~gradsift.core.errors.InvalidOptionError` naming what is wrong, before
anything is loaded:

* the entry has the keys a hook state has (``capacities``, ``server_feedback`` and ``method``
  may be missing, as in older checkpoints), and ``step`` is an integer >= 0;
* the settings saved with it (:func:`gradsift.hook.handshake.hook_settings`: the compressor,
  its options, the hook's options) are this hook's, setting by setting (but two that the run
  moves after it is built: :func:`check_settings`);
* every store entry is a 1-D tensor under a key of this model's parameter numbers (an
  int, or a sorted tuple of distinct ones) once the hook is attached: the balanced
  exchange's bounds are integers in ``[0, n]``, every other table holds finite floating-point
  values, one per element of its key's parameters (``n``);
* a payload capacity is an integer in ``[1, n]``, a padding factor lies in ``[1/4, 1]``;
  weight decays are finite and >= 0 under parameter numbers; momentum lies in ``[0, 1)``;
  telemetry totals are finite and >= 0;
* in the compressor's state every Python integer is >= 0 and every float and floating-point
  tensor finite (its own ``load_state_dict`` checks its structure);
* ``compressor="auto"``'s methods left (``auto.left``, where saved) map method names to the
  text of what the script did.

Before the hook is attached (no parameter numbers yet) the keys and lengths cannot be
checked; everything else is.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any, TypeGuard

import torch

from gradsift.core.errors import InvalidOptionError
from gradsift.exchanges.balanced import BOUNDS
from gradsift.hook.capacity import FLOOR
from gradsift.hook.handshake import TAKEN_DECAY, hook_settings
from gradsift.hook.state import GradsiftHookState

#: Keys every hook state entry has; :data:`OPTIONAL_KEYS` may be missing.
REQUIRED_KEYS = frozenset({"step", "feedback", "store", "compressor", "weight_decay", "telemetry"})
#: "auto": auto's choice; "orders": the parameters' memory orders (:func:`~gradsift.hook.resumable.check_orders`);
#: "worker": the rank that saved it (:mod:`gradsift.core.worker_state`).
OPTIONAL_KEYS = frozenset({"server_feedback", "capacities", "auto", "method", "orders", "worker"})
#: Store tables of integers (the others hold floating-point values, one per element).
INTEGER_TABLES = frozenset({BOUNDS})


def check_hook_entry(
    state: GradsiftHookState, entry: Any, settings: Mapping[str, str] | None, where: str = "checkpoint"
) -> None:
    """Raise :class:`InvalidOptionError` naming the first thing in ``entry`` (one rank's
    ``state.state_dict()`` as saved, ``settings`` the :func:`hook_settings` saved with it, if
    any) that ``state`` must not load (module docstring); ``where`` names the source."""
    if not isinstance(entry, dict):
        raise InvalidOptionError(f"{where}: a hook state must be a dict, got {type(entry).__name__}")
    missing, unknown = REQUIRED_KEYS - set(entry), set(entry) - REQUIRED_KEYS - OPTIONAL_KEYS
    if missing or unknown:
        raise InvalidOptionError(
            f"{where} is not a gradsift hook state: missing {sorted(missing)}, unknown {sorted(map(str, unknown))}"
        )
    if settings is not None:
        check_settings(state, settings, where)
    step = entry["step"]
    if type(step) is not int or step < 0:
        raise InvalidOptionError(f"{where}: step must be an integer >= 0, got {step!r}")
    numels = state.layout.numels
    _check_store(entry["store"], numels, where)
    _check_capacities(entry.get("capacities", {}), numels, where)
    _check_feedback(entry["feedback"], where)
    _check_weight_decay(entry["weight_decay"], numels, where)
    _check_telemetry(entry["telemetry"], where)
    _check_left(entry.get("auto", {}), where)
    _check_numbers(entry["compressor"], f"{where} compressor state")


def check_settings(state: GradsiftHookState, settings: Mapping[str, str], where: str) -> None:
    """Refuse a checkpoint saved by a hook with other :func:`hook_settings`, naming each; but
    the weight decay taken from the optimizer (the entry's own ``weight_decay`` is what loads,
    and a schedule may have moved it since the optimizer was built, as it moves the optimizer's
    groups that its checkpoint restores) and the scaler, while this hook still looks for one
    (discovery adopts the ``GradScaler`` that scaled a loss at the first step, after the load;
    the residuals are kept unscaled either way)."""
    if not isinstance(settings, Mapping):
        raise InvalidOptionError(f"{where}: the saved settings must be a dict, got {type(settings).__name__}")
    ours = hook_settings(state)
    restored = {TAKEN_DECAY}  # the entry's own weight_decay, which a schedule may have moved, loads
    if state.discovering and state.options.scaler is None:
        restored.add("scaler")  # found at the first step, after this load
    settings = {name: text for name, text in settings.items() if name not in restored}
    ours = {name: text for name, text in ours.items() if name not in restored}
    differ = [
        f"  {name}: {settings.get(name, '(not set)')} in the checkpoint, {ours.get(name, '(not set)')} in this hook"
        for name in sorted(set(ours) | set(settings))
        if settings.get(name) != ours.get(name)
    ]
    if differ:
        raise InvalidOptionError(
            f"{where} was saved by a hook with other settings; build the hook as it was:\n"
            + "\n".join(differ)
        )


def _numbers(key: Hashable) -> tuple[int, ...] | None:
    """The parameter numbers of ``key`` (an int, or a sorted tuple of distinct ints), else None."""
    numbers: Any = (key,) if type(key) is int else key
    if not isinstance(numbers, tuple) or not numbers or not all(type(n) is int for n in numbers):
        return None
    return numbers if list(numbers) == sorted(set(numbers)) else None


def _key_numel(key: Hashable, numels: Mapping[int, int], where: str) -> int | None:
    """The elements of the parameters ``key`` names (None before the hook is attached)."""
    numbers = _numbers(key)
    if numbers is None:
        raise InvalidOptionError(f"{where}: key {key!r} is not a parameter number or a sorted tuple of them")
    if not numels:
        return None
    strangers = [n for n in numbers if n not in numels]
    if strangers:
        raise InvalidOptionError(
            f"{where}: key {key!r} names parameters {strangers} this model does not have "
            f"(it has {len(numels)}): a checkpoint of another model"
        )
    return sum(numels[n] for n in numbers)


def _check_store(store: Any, numels: Mapping[int, int], where: str) -> None:
    if (
        not isinstance(store, dict)
        or not isinstance(store.get("tables"), dict)
        or not isinstance(store.get("layouts"), dict)
    ):
        raise InvalidOptionError(f"{where}: the store must be a dict with dicts 'tables' and 'layouts'")
    for name, table in store["tables"].items():
        if not isinstance(table, dict):
            raise InvalidOptionError(f"{where}: store table {name!r} must be a dict key -> tensor")
        for key, tensor in table.items():
            at = f"{where}: store[{name!r}][{key!r}]"
            numel = _key_numel(key, numels, at)
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
                raise InvalidOptionError(f"{at} must be a 1-D tensor, got {_kind(tensor)}")
            if name in INTEGER_TABLES:
                _check_bounds(tensor, numel, at)
                continue
            if not tensor.is_floating_point():
                raise InvalidOptionError(f"{at} must hold floating-point values, got {tensor.dtype}")
            if numel is not None and tensor.numel() != numel:
                raise InvalidOptionError(
                    f"{at} holds {tensor.numel()} values for parameters of {numel} elements: "
                    "a checkpoint of another model or granularity"
                )
            if not bool(torch.isfinite(tensor).all()):
                raise InvalidOptionError(f"{at} holds NaN or Inf: every later step would be rolled back")
    for key, order in store["layouts"].items():
        _key_numel(key, numels, f"{where}: store layout {key!r}")
        numbers = _numbers(key)
        if not isinstance(order, (tuple, list)) or sorted(order) != list(numbers or ()):
            raise InvalidOptionError(
                f"{where}: store layout {key!r} must order its key's numbers, got {order!r}"
            )


def _check_bounds(tensor: torch.Tensor, numel: int | None, at: str) -> None:
    if tensor.is_floating_point() or tensor.dtype == torch.bool:
        raise InvalidOptionError(f"{at} must hold integers, got {tensor.dtype}")
    high = numel if numel is not None else torch.iinfo(tensor.dtype).max
    if tensor.numel() and not bool(((tensor >= 0) & (tensor <= high)).all()):
        raise InvalidOptionError(f"{at} must lie in [0, {high}]")


def _check_capacities(capacities: Any, numels: Mapping[int, int], where: str) -> None:
    rooms = capacities.get("rooms", {}) if isinstance(capacities, dict) else None
    factors = capacities.get("factors", {}) if isinstance(capacities, dict) else None
    if not isinstance(rooms, dict) or not isinstance(factors, dict):
        raise InvalidOptionError(f"{where}: capacities must be a dict with dicts 'rooms' and 'factors'")
    for key, room in rooms.items():
        numel = _key_numel(key, numels, f"{where}: capacity of {key!r}")
        high = numel if numel is not None else math.inf
        if type(room) is not int or not 1 <= room <= high:
            raise InvalidOptionError(
                f"{where}: the capacity of {key!r} must be an integer in [1, {high}] (its elements), got {room!r}"
            )
    for key, factor in factors.items():
        _key_numel(key, numels, f"{where}: padding factor of {key!r}")
        if not _real(factor) or not FLOOR <= factor <= 1:
            raise InvalidOptionError(
                f"{where}: the padding factor of {key!r} must lie in [{FLOOR}, 1], got {factor!r}"
            )


def _check_feedback(feedback: Any, where: str) -> None:
    if feedback is None:
        return
    momentum = feedback.get("momentum") if isinstance(feedback, dict) else None
    if not (_real(momentum) and 0 <= momentum < 1):
        raise InvalidOptionError(
            f"{where}: feedback must be None or {{'momentum': m}} with m in [0, 1), got {feedback!r}"
        )


def _check_weight_decay(decays: Any, numels: Mapping[int, int], where: str) -> None:
    if not isinstance(decays, dict):
        raise InvalidOptionError(f"{where}: weight_decay must be a dict parameter number -> decay")
    for number, decay in decays.items():
        if type(number) is not int:
            raise InvalidOptionError(f"{where}: weight_decay key {number!r} is not a parameter number")
        _key_numel(number, numels, f"{where}: weight_decay")
        if not _real(decay) or decay < 0:
            raise InvalidOptionError(
                f"{where}: weight_decay[{number}] must be finite and >= 0, got {decay!r}"
            )


def _check_telemetry(telemetry: Any, where: str) -> None:
    total = telemetry.get("total") if isinstance(telemetry, dict) else None
    if not isinstance(total, dict):
        raise InvalidOptionError(f"{where}: telemetry must be {{'total': {{name: number}}}}")
    for name, value in total.items():
        if not _real(value) or value < 0:
            raise InvalidOptionError(
                f"{where}: telemetry total {name!r} must be finite and >= 0, got {value!r}"
            )


def _check_left(auto: Any, where: str) -> None:
    left = auto.get("left", {}) if isinstance(auto, dict) else None
    if not isinstance(left, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in left.items()
    ):
        raise InvalidOptionError(f"{where}: auto's methods left must be {{method name: why}}, got {left!r}")


def _check_numbers(value: Any, at: str) -> None:
    """Every Python integer in ``value`` >= 0, every float and floating-point tensor finite."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_numbers(item, f"{at}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_numbers(item, f"{at}[{index}]")
    elif isinstance(value, bool):
        return
    elif isinstance(value, int) and value < 0:
        raise InvalidOptionError(f"{at} must be >= 0, got {value}")
    elif isinstance(value, float) and not math.isfinite(value):
        raise InvalidOptionError(f"{at} must be finite, got {value}")
    elif (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and not bool(torch.isfinite(value).all())
    ):
        raise InvalidOptionError(f"{at} holds NaN or Inf")


def _real(value: Any) -> TypeGuard[float]:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D tensor"
    return type(value).__name__
