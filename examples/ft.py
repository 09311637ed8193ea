"""The reference trainer's fault-tolerant replica groups (``--ft``), on torchft (docs/ft.md).

With ``--ft`` each ``dp_replicate`` replica group is a job of its own: its own torchrun world holding the other
mesh dimensions (FSDP shards the weights within the group), started with ``REPLICA_GROUP_ID``,
``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE`` (``opsd.protocol.ft``). The groups meet in torchft's Manager:
at every step, rank 0 of each group asks the Lighthouse for a quorum of the groups alive, and

- gradients are averaged over the groups of the step's quorum: FSDP reduce-scatters within the group, then its
  all-reduce hook averages each shard over the groups through the Manager's reconfigurable process group (what
  HSDP does across replicas, made fault tolerant); the monitor counts it as the ``dp_replicate`` all-reduce;
- a group behind the quorum's step (a restarted one) heals: each of its ranks fetches the model, optimizer and LR
  schedule of the same rank of a group at the quorum's step, over HTTP, and loads them before its optimizer step;
  its own gradients count as zero in that step, and it ends the step with its peers' weights;
- a step is committed when every rank of the group votes for it and at least ``min_replicas`` groups took part;
  otherwise its update is discarded and the same batch is trained again;
- a step's batch is the job's step (sequence indices of ``TokenSource``), so the groups train their shares of one
  global batch, and a healed group goes on with its peers' next batch.

A quorum that does not form within the quorum timeout (fewer than ``min_replicas`` groups alive) raises
``NoQuorumError``: the trainer exits with ``EXIT_NO_QUORUM`` rather than train on alone.

A group relaunched while its peers train (``heal_from_peer``: ``OPSD_FT_HEAL_FROM_PEER=1``) reads no checkpoint: it
heals from a live peer. Until it has, it commits nothing: a step in which it would train from what it has (alone
in its quorum, or no peer ahead of it) is discarded, and when no peer has let it heal within the quorum timeout it
raises ``NoQuorumError`` too (then only a whole-job restart from the checkpoint is left).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchft.manager import Manager
from torchft.process_group import ProcessGroupNCCL

from examples.data import TokenSource
from examples.ft_transport import PeerTransport
from examples.parallelize import ParallelModel
from opsd.protocol.ft import HEAL_MIN_BYTES_PER_S, ReplicaGroupEnv
from opsd.protocol.mesh import MeshSpec
from trainer_hooks.collectives import TRACER
from trainer_hooks.integrations.torchft import AbortableGloo, PeerFailures, wait_or_abort
from trainer_hooks.monitor import Monitor

log = logging.getLogger(__name__)


class HealTooSlowError(RuntimeError):
    """This group could not read a peer's state within its deadline (``PeerTransport.read_limit_s``): it ends, rather
    than try again in each quorum and hold its peers that long every time (opsd relaunches it)."""


class NoQuorumError(RuntimeError):
    """No quorum of ``min_replicas`` replica groups formed within the quorum timeout (or the Lighthouse could not
    be reached for as long)."""


def in_job(model: ParallelModel, spec: MeshSpec, group: int) -> ParallelModel:
    """The group's model seen in the job's layout: its batch shards and coordinates are those of replica
    ``group`` of ``spec``."""
    return replace(model, spec=spec, coords={**model.coords, "dp_replicate": group})


class _Quorums:
    """torchft's ManagerClient, keeping the Lighthouse's last quorum and handing the Manager quorum ids that name one
    quorum's life: its Lighthouse's id, its members and the step it formed at.

    torchft's Manager builds a new process group across the groups only when a quorum's id differs from the last
    one's, and names the new group's rendezvous keys (in the primary group's store) by that id. A Lighthouse numbers
    its quorums from 1 when it starts, so after a Lighthouse restart its ids come again:
    - a quorum of other members under an id the groups last saw: a group kept the process group of the old members
      (seen: one group trained alone on the old group, the other waited for a quorum, both until their timeout);
    - the same members under the same id as before the restart, after one group trained alone meanwhile: that group
      built a new process group under the old keys, which the store still held, while the other, seeing its last
      quorum again, built none; the rendezvous timed out, the heal with it, and the group behind exited 75 (seen in
      the soak: ``tests/test_local_lighthouse.py``).
    The id the Manager gets is a hash of the Lighthouse's id, the members' ids and the step the quorum formed at (its
    ``max_step`` when a group first sees it): the same in every group of the quorum, and new for a quorum formed
    again. A group sees the same quorum as long as its Lighthouse id and members stay and its step goes on by at most
    one a request (a step committed); a group that was out of a quorum meanwhile sees a jump, or other members."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.quorum_id = -1  # the Lighthouse's id of the last quorum
        self.groups: tuple[int, ...] = ()  # the replica groups in it
        self._last: tuple[int, tuple[str, ...]] | None = None  # the last quorum's Lighthouse id and members
        self._step = -1  # its max_step at the last request
        self._formed_step = -1  # its max_step when it was first seen

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        members = tuple(sorted(result.replica_ids))
        quorum, step = (int(result.quorum_id), members), int(result.max_step)
        if quorum != self._last or not self._step <= step <= self._step + 1:
            self._formed_step = step  # a quorum formed (again)
        self._last, self._step = quorum, step
        self.quorum_id = int(result.quorum_id)
        self.groups = tuple(sorted({int(m.split(":")[0].rsplit("_", 1)[-1]) for m in members}))
        named = hashlib.sha256(f"{result.quorum_id}:{','.join(members)}:{self._formed_step}".encode()).digest()
        return _Renamed(result, int.from_bytes(named[:7], "big"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class _Renamed:
    """A quorum result with another ``quorum_id``."""

    def __init__(self, result: Any, quorum_id: int) -> None:
        self._result = result
        self.quorum_id = quorum_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._result, name)


def _local(value: Any) -> Any:
    """A DTensor's local shard (this rank's part), anything else as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


def _map_state(state: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(state, dict):
        return {k: _map_state(v, fn) for k, v in state.items()}
    if isinstance(state, list):
        return [_map_state(v, fn) for v in state]
    return fn(state)


class FaultTolerance:
    """This rank's part in the fault-tolerant job: torchft's Manager over the replica groups, FSDP's all-reduce hook
    across them, the state a healing peer fetches, and the step's quorum for the monitor.

    Build it after the model is sharded (``parallelize(..., shard_always=True)``) and any checkpoint loaded, right
    before the first step: the Lighthouse counts the group as alive from here on, and the other groups wait for a
    group that is alive but has not asked to join."""

    def __init__(
        self,
        replica: ReplicaGroupEnv,
        model: ParallelModel,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        data: TokenSource,
        *,
        monitor: Monitor | None = None,
        peer_failures: PeerFailures | None = None,
        kill_while_healing: bool = False,
        heal_read_bytes_per_s: float | None = None,
        heal_min_bytes_per_s: float = HEAL_MIN_BYTES_PER_S,
        wedge_at: tuple[int, int] = (0, 0),
        wedge_file: str | None = None,
    ) -> None:
        self.replica = replica
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data = data
        self.monitor = monitor
        self.peer_failures = peer_failures  # the groups opsd names failed: a collective with them is abandoned
        self.kill_while_healing = kill_while_healing  # fault injection (tests): die with the peer's state in hand
        self.wedge_at, self.wedge_file = wedge_at, wedge_file  # fault injection: (step, group) that hangs
        # the sharded parameters, taken before any forward pass: FSDP swaps a module's parameters for unsharded
        # ones during forward, and the Manager reads the state on its own thread, while forward runs
        self._params = dict(model.module.named_parameters())
        self._order = [p for g in optimizer.param_groups for p in g["params"]]
        t = replica.timeouts
        backend = ProcessGroupNCCL if torch.cuda.is_available() else AbortableGloo
        self.pg = backend(timeout=timedelta(seconds=t.timeout_s))
        host = replica.url_host(socket.gethostname())  # its pod's IP on Kubernetes, where names do not resolve
        timeout = timedelta(seconds=t.timeout_s)
        self.transport = PeerTransport(timeout, host, heal_read_bytes_per_s, heal_min_bytes_per_s)
        # a peer's state: its shards of the weights and of AdamW's two moments (this rank's have no moments yet
        # when it is relaunched to heal)
        self.transport.state_bytes = 3 * sum(_local(p).numel() * p.element_size() for p in self._params.values())
        self._store = None
        store_addr = os.environ.get("MASTER_ADDR")
        store_port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None
        if store_addr is None or store_port is None:  # one rank without torchrun: the group's store is ours
            self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "127.0.0.1", self._store.port
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=self._load_peer_state,
            state_dict=self._peer_state,
            min_replica_size=replica.min_replicas,
            timeout=timedelta(seconds=t.timeout_s),
            quorum_timeout=timedelta(seconds=t.quorum_timeout_s),
            connect_timeout=timedelta(seconds=t.connect_timeout_s),
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=replica.lighthouse,
            hostname=host,
            replica_id=f"replica_group_{replica.group}",
            checkpoint_transport=self.transport,
            # every group builds the same initial weights from the seed (and a resumed one loads them): no copy
            init_sync=False,
            quorum_retries=t.quorum_retries,
        )
        self.manager.load_state_dict({"step": data.position, "batches_committed": 0})
        self.quorums = self.manager._client = _Quorums(self.manager._client)  # see _Quorums
        for module in model.module.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(self._reduce_across_groups)
        if monitor is not None:
            monitor.watch_replica_group(replica.group, replica.groups)
        self.heals = 0
        self.healing_total_s = 0.0  # fetching and loading a peer's state, over every heal
        self.discarded = 0  # steps of this group not committed (their update thrown away, their batch done again)
        self.commit_times_unix_s: list[float] = []  # when each committed step ended
        self.awaiting_peer = replica.heal_from_peer  # relaunched while its peers train: commits nothing before it heals
        self._awaiting_since_s: float | None = None
        self._quorum_ready = False
        self._no_quorum: BaseException | None = None
        self._quorum_wait_s = 0.0
        self._quorum: tuple[int, tuple[int, ...]] = (-1, ())
        self._quorum_since_s = 0.0  # when this rank first had the quorum it is in (time.monotonic)
        self._apply_s = 0.0
        self._fetched_s = 0.0
        self._group_loss: torch.Tensor | None = None

    # -- the step ------------------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """Ask for the step's quorum (answered while forward runs) and clear the gradients; the data position is set
        to the job's step."""
        self._quorum_ready = False
        self._no_quorum = None
        self._quorum_wait_s = self._apply_s = 0.0
        self._fetched_s = self.transport.fetch_s
        self.manager.start_quorum()
        self.optimizer.zero_grad(set_to_none=True)
        self.data.position = self.manager.current_step()

    def _await_quorum(self) -> bool:
        """Wait for the step's quorum (once a step, timed); False when there is none (``finish_step`` raises)."""
        if not self._quorum_ready:
            self._quorum_ready = True
            start = time.perf_counter()
            try:
                self.manager.wait_quorum()
            except Exception as exc:
                self._no_quorum = exc
            self._quorum_wait_s = time.perf_counter() - start
            quorum = (self.quorums.quorum_id, self.quorums.groups)
            if quorum != self._quorum:
                self._quorum, self._quorum_since_s = quorum, time.monotonic()
        return self._no_quorum is None

    def _reduce_across_groups(self, grad: torch.Tensor) -> None:
        """FSDP's all-reduce hook: average this rank's reduce-scattered gradient shard over the quorum's groups (a
        group that heals contributes zeros). Errors are the Manager's to handle: the step is then not committed."""
        if self._await_quorum():
            self._wedge_now()
            start = time.perf_counter()
            self._wait(self.manager.allreduce(grad))
            TRACER.record("dp_replicate", "all_reduce", grad.numel() * grad.element_size(), time.perf_counter() - start)

    def finish_step(self, local_loss: torch.Tensor | None, pp: int) -> float | None:
        """After forward and backward: the step's mean loss over the quorum's groups, the commit vote, and the
        optimizer and LR steps when committed; the loss, or None when the step was discarded. Raises
        ``NoQuorumError``, or ``HealTooSlowError``."""
        if not self._await_quorum():
            raise NoQuorumError(f"no quorum within {self.replica.timeouts.quorum_timeout_s} s: {self._no_quorum}")
        total = torch.zeros((), device=self._device) if local_loss is None else local_loss.detach().clone()
        dist.all_reduce(total)  # the group's sum; then summed over the groups (zero from a healing one)
        start = time.perf_counter()
        self._wait(self.manager.allreduce(total, reduce_op=dist.ReduceOp.SUM))
        TRACER.record("dp_replicate", "all_reduce", total.element_size(), time.perf_counter() - start)
        self._hold_until_healed()
        if self.transport.gave_up:
            raise HealTooSlowError(self.transport.gave_up)
        committed = bool(self.manager.should_commit())
        if self.awaiting_peer and self.heals:
            self.awaiting_peer = False
            log.info("healed from a live peer at step %d: no checkpoint read", self.manager.current_step())
        loss = None
        if committed:
            self.commit_times_unix_s.append(time.time())
            self.optimizer.step()
            self.scheduler.step()
            loss = float(total) / (self.manager.num_participants() * dist.get_world_size() // pp)
        else:
            self.discarded += 1
        self.data.position = self.manager.current_step()
        self._report(committed)
        return loss

    def _wedge_now(self) -> None:
        """Fault injection: wedge (``wedge``) at the step asked for, in the first launch of the group asked for."""
        step, group = self.wedge_at
        first_launch = not self.replica.heal_from_peer
        if step and self.manager.current_step() == step and self.replica.group == group and first_launch:
            wedge(2 * self.replica.timeouts.timeout_s, self.wedge_file)

    def _wait(self, work: Any) -> None:
        """Wait for a collective across the quorum's groups, or abandon it at once when opsd names one of them failed
        (``trainer_hooks.integrations.torchft``: the step is then not committed)."""
        groups, since_s = self.quorums.groups, self._quorum_since_s
        wait_or_abort(work, self.manager, self.pg, self.peer_failures, groups, since_s)

    def _hold_until_healed(self) -> None:
        """A group that is to heal from a peer and does not heal this step (alone in its quorum, or no peer ahead of
        it) would train from its initial state: the step is discarded (an error reported to the Manager). Raises
        ``NoQuorumError`` when no peer let it heal within the quorum timeout."""
        if not self.awaiting_peer or not self.manager.is_participating():  # not participating: it heals this step
            return
        now_s = time.monotonic()
        if self._awaiting_since_s is None:
            self._awaiting_since_s = now_s
        waited_s = now_s - self._awaiting_since_s
        if waited_s > self.replica.timeouts.quorum_timeout_s:
            raise NoQuorumError(f"no live peer to heal from within {self.replica.timeouts.quorum_timeout_s} s")
        self.manager.report_error(RuntimeError(f"waiting for a live peer to heal from ({waited_s:.1f} s)"))

    @property
    def _device(self) -> torch.device:
        return next(iter(self._params.values())).device

    def saves_checkpoints(self) -> bool:
        """Whether this group writes the job's checkpoints this step: the first group of the quorum at its step (one
        group saves; every group has the whole model, and any of them can load it)."""
        return self.manager.participating_rank() == 0

    def _report(self, committed: bool) -> None:
        healing_s = self._apply_s + (self.transport.fetch_s - self._fetched_s)
        self.healing_total_s += healing_s
        if self.monitor is None:
            return
        self.monitor.record_quorum(
            step=self.manager.current_step(),
            quorum_id=max(self.quorums.quorum_id, 0),
            quorum_replicas=len(self.quorums.groups),
            participants=self.manager.num_participants(),
            committed=committed,
            healing_s=healing_s,
            quorum_wait_s=self._quorum_wait_s,
        )

    # -- healing -------------------------------------------------------------------------------------------------
    def _peer_state(self) -> dict[str, Any]:
        """What a healing peer's rank of the same group rank fetches: this rank's shards of the model and of the
        optimizer state, and the LR schedule (read on the Manager's thread; the step's update waits for it)."""
        return {
            "model": {name: _local(p).detach() for name, p in self._params.items()},
            "optim": _map_state(self.optimizer.state_dict(), _local),
            "scheduler": self.scheduler.state_dict(),
        }

    def _load_peer_state(self, state: dict[str, Any]) -> None:
        """Load a peer's state fetched by the Manager: the shards are copied into this rank's, the optimizer's are
        made DTensors like the parameters they belong to."""
        if self.kill_while_healing:
            log.warning("fault injection: killed while healing, with the peer's state fetched")
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.perf_counter()
        with torch.no_grad():
            for name, param in self._params.items():
                _local(param).copy_(state["model"][name])
        optim = state["optim"]
        for index, entries in optim["state"].items():
            param = self._order[int(index)]
            if isinstance(param, DTensor):
                for key, value in entries.items():
                    if isinstance(value, torch.Tensor) and value.shape == param.to_local().shape and value.dim():
                        entries[key] = DTensor.from_local(
                            value,
                            param.device_mesh,
                            param.placements,
                            run_check=False,
                            shape=param.shape,
                            stride=param.stride(),
                        )
        self.optimizer.load_state_dict(optim)
        self.scheduler.load_state_dict(state["scheduler"])
        self.heals += 1
        self._apply_s += time.perf_counter() - start
        log.info("healed from a peer at step %d", self.manager.current_step())

    def close(self) -> None:
        if self.peer_failures is not None:
            self.peer_failures.close()
        self.manager.shutdown(wait=False)


def wedge(hold_s: float, marker: str | None) -> None:
    """Fault injection: this rank hangs as on a GPU fallen off the bus, with its connections left open, as a dead NCCL
    peer's are to its survivors (they see no error, and wait until their timeout; on gloo a killed peer's closed
    connections would fail their collective at once). A child in a session of its own holds this process's sockets
    for ``hold_s`` (past the survivors' timeout), after opsd's recovery kills the process too; the process stops
    itself (SIGSTOP), having touched ``marker``."""
    if os.fork() == 0:
        os.setsid()
        time.sleep(hold_s)
        os._exit(0)
    log.warning("fault injection: wedged (SIGSTOP), its connections held %.0f s", hold_s)
    if marker:
        with open(marker, "a"):
            pass
    os.kill(os.getpid(), signal.SIGSTOP)
