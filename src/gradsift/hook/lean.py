"""Stock DDP's allreduce as ``compressor="auto"``'s dense steps run it (:mod:`gradsift.hook.auto`).

``allreduce(g / W)`` of the bucket in place, as PyTorch's ``allreduce_hook``, with no more
Python than that hook's but the bucket's bytes counted on the host (the ring allreduce's:
:func:`~gradsift.core.collectives.ring_allreduce_received`) -- no timing, no device work, no
non-finite check (so only under ``nonfinite="propagate"``, where stock DDP's NaNs are what
the policy hands on). The last bucket of a step ends the step in the state's telemetry.
"""

import torch
import torch.distributed as dist

from gradsift.core.collectives import ring_allreduce_received
from gradsift.core.telemetry import BucketRecord
from gradsift.hook.state import GradsiftHookState


class LeanAllreduce:
    """The lean dense route of ``state`` (module docstring), one bucket per call."""

    def __init__(self, state: GradsiftHookState) -> None:
        self.state = state
        self._records: list[BucketRecord] = []

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer, group = bucket.buffer(), self.state.process_group
        world = dist.get_world_size(group)
        record = GradsiftHookState.bucket_record(buffer)
        record.add_tensor(buffer.numel(), dense=True)
        nbytes = record.dense_bytes
        record.add_bytes(sent=nbytes, padded=nbytes, received=ring_allreduce_received(nbytes, world))
        self._records.append(record)
        work = dist.all_reduce(buffer.div_(world), group=group, async_op=True)
        if bucket.is_last():
            self.state.telemetry.end_step(self.state.ledger.step, self._records, skipped=False)
            self.state.ledger.step += 1
            self._records = []
        return work.get_future().then(lambda done: done.value()[0])
