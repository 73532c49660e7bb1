"""DDP's ``join()`` for uneven inputs, as ``compressor="auto"`` (:mod:`gradsift.hook.auto`) meets it.

Under ``with ddp.join():`` a rank that ran out of inputs shadows DDP's own collectives only --
the buckets' hooks, on zero buckets (``Reducer._run_comm_hook``) -- and takes no optimizer
step, so it takes no part in ``auto``'s probes, agreements and drift windows (its module
docstring's steps 1, 2 and 5). From the first step that the join is on (every rank enters it
at the same step), ``auto`` makes none: a run still measuring runs stock DDP's allreduce
(``none``) from that step, leaving its start method as any switch does
(:func:`gradsift.hook.handover.leave`: SGD gets its momentum back); a choice made before stands;
no bucket is kept and the step time is no longer watched (``AutoHookState``'s
``_run_dense`` and its optimizer step post-hook). Stock DDP is what ``auto`` keeps
where it cannot measure.
"""

import torch


def joined(ddp_model: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether DDP's join context is on: DDP's ``_join_config`` (its state as a ``Joinable``,
    set on entering ``ddp.join()``), read with a default so a DDP without it reads as off."""
    return bool(getattr(getattr(ddp_model, "_join_config", None), "enable", False))
