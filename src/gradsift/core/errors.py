"""Exception types raised by gradsift.

Every error names the argument that is wrong and what was allowed, so a user can
fix the call without reading the source. The classes subclass the built-in
``ValueError``/``TypeError`` so ordinary ``except ValueError`` code keeps working.
"""

from __future__ import annotations


class GradsiftError(Exception):
    """Base class of every error gradsift raises on purpose."""


class InvalidOptionError(GradsiftError, ValueError):
    """An option or argument has a value outside its allowed range."""


class InvalidTensorError(GradsiftError, TypeError):
    """A tensor has a dtype, device or layout that the operation does not accept."""


class UnknownCompressorError(GradsiftError, ValueError):
    """A compressor name is not in the registry; the message lists the known names."""


class NonFiniteGradientError(GradsiftError, FloatingPointError):
    """A gradient holds NaN or +-Inf.

    Raised instead of compressing (and, in the DDP hook under ``nonfinite="raise"``, on
    every rank together where the step settles, before the optimizer steps), because a
    non-finite element would otherwise be sent, summed and copied into every worker's
    parameters.
    """


class WireFormatError(GradsiftError, ValueError):
    """A message received from a peer is malformed (length, dtype or index range)."""


class MissingExtraError(GradsiftError, ImportError):
    """An optional dependency is not installed; the message names the ``pip install gradsift[EXTRA]`` to run."""


class PeerFailureError(GradsiftError, RuntimeError):
    """A collective failed or timed out: a peer process is gone, stalled or disagrees.

    Raised by the DDP hook on the surviving ranks (within the process group's timeout)
    instead of blocking forever; the message names the rank, the world size and the
    backend's own error.
    """


class UntrustedDataError(InvalidOptionError):
    """Bytes from outside (a checkpoint file, a peer's state) hold something other than plain
    data -- tensors, numbers, strings, ``None``, lists, tuples and dicts of them -- and were
    refused without building it (no ``__reduce__`` of theirs ran)."""


class SettingsMismatchError(InvalidOptionError):
    """The ranks of a group were given different settings that shape the messages or the
    result (compressor, its options, the hook's); raised on every rank at registration,
    naming each setting and the ranks' values."""
