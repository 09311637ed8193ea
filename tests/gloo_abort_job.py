"""For tests/test_torchft_abort.py: two processes on one cross-group gloo process group of torchft's, as two replica
groups' ranks hold one. ``python -m tests.gloo_abort_job <rank> <port> <policy file> <out json> <group class>``.

Rank 1 (group 1) takes part in one all-reduce, then stops itself (SIGSTOP) with its connections open: what a dead
NCCL peer looks like to its survivors. Rank 0 (group 0) starts a second all-reduce, which waits on rank 1, through
``trainer_hooks.integrations.torchft.wait_or_abort``, watching the policy file (``PeerFailures``, the reader the
trainer uses), then reconfigures its process group for a quorum of itself alone and all-reduces on it, as the
Manager's next quorum does. ``<group class>``: ``abortable`` (``AbortableGloo``) or ``torchft`` (torchft's own
``ProcessGroupGloo``). It writes when each of these ended, in seconds from the second all-reduce's start, and when the
all-reduce ended on the wall clock.

The Manager is a stand-in that records ``report_error`` (the only call made of it), and the work is the process
group's, in the attribute where torchft's managed work keeps it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore
from torch.distributed import AllreduceOptions
from torchft.process_group import ProcessGroupGloo

from trainer_hooks.integrations.torchft import AbortableGloo, PeerFailures, wait_or_abort
from trainer_hooks.policy_reader import PolicyReader

TIMEOUT_S = 4


class Manager:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def report_error(self, e: Exception) -> None:
        self.errors.append(f"{type(e).__name__}: {e}")


class Work:
    def __init__(self, work: dist.Work) -> None:
        self._work = work

    def wait(self) -> bool:
        return bool(self._work.wait())


def main() -> None:
    rank, port, policy, out, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5]
    store = TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
    pg_class = AbortableGloo if kind == "abortable" and rank == 0 else ProcessGroupGloo
    pg = pg_class(timeout=timedelta(seconds=TIMEOUT_S))
    pg.configure(f"127.0.0.1:{port}/quorum-1", f"replica_group_{rank}", rank, 2)
    opts = AllreduceOptions()  # a sum
    pg.allreduce([torch.ones(4)], opts).wait()
    if rank == 1:
        store.set("stopping", "1")
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    failures = PeerFailures(PolicyReader(policy, check_every_s=0.05), 0, poll_s=0.05)
    manager = Manager()
    since_s = time.monotonic()
    store.wait(["stopping"])
    start = time.monotonic()
    Path(policy).with_name("waiting").touch()  # the test names group 1 failed from here on
    done = wait_or_abort(Work(pg.allreduce([torch.ones(4)], opts)), manager, pg, failures, (0, 1), since_s)
    ended_s = time.monotonic() - start
    pg.configure(f"127.0.0.1:{port}/quorum-2", "replica_group_0", 0, 1)
    reconfigured_s = time.monotonic() - start
    alone = torch.ones(4)
    pg.allreduce([alone], opts).wait()
    result = {
        "completed": done,
        "ended_s": ended_s,
        "ended_unix_s": time.time() - (time.monotonic() - start - ended_s),
        "reconfigured_s": reconfigured_s,
        "alone": alone.tolist(),
        "errors": manager.errors,
    }
    out.write_text(json.dumps(result))
    os._exit(0)  # a set-aside group's pending operation is not waited for at exit


if __name__ == "__main__":
    main()
