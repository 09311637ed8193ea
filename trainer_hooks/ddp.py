"""DDP's gradient all-reduces through ``torch.distributed`` (``Monitor.watch_ddp``), one at a time on gloo.

torch's reference ``allreduce_hook`` (the same averaging as DDP's built-in reduction) all-reduces each bucket as soon
as it is ready, asynchronously. On a gloo group several are then in flight at once, and two collectives in flight on
one gloo group can corrupt the process's heap ([docs/crash.md](../docs/crash.md)): a rank of a two-rank DDP job on
gloo died of SIGABRT ("terminate called without an active exception") under a loaded test suite. So on gloo each
bucket's all-reduce waits for the one before it; on NCCL they overlap as DDP means them to.
"""

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel


def trace_buckets(model: DistributedDataParallel) -> None:
    """Register the comm hook on ``model`` (before its first step): ``allreduce_hook``, each call after the previous
    one's all-reduce is done when the group is gloo's."""
    group = model.process_group
    one_at_a_time = dist.get_backend(group) == dist.Backend.GLOO
    last: list[torch.futures.Future[torch.Tensor]] = []  # the previous bucket's all-reduce

    def bucket_allreduce_hook(
        process_group: dist.ProcessGroup, bucket: GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        if one_at_a_time and last:
            last[0].wait()
        future = allreduce_hook(process_group, bucket)
        last[:] = [future]
        return future

    model.register_comm_hook(group, bucket_allreduce_hook)
