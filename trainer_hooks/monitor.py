"""The per-rank training monitor: one report per step with time, tokens, MFU, memory and collectives.

    monitor = Monitor.from_mesh(mesh, shape, MonitorConfig(run_id="llama-70b"))
    for batch in loader:
        with monitor.step(tokens=batch.numel()):
            train_step(batch)

``tokens`` is the number of tokens of this rank's data-parallel shard in the step (whole sequences: ranks that
differ only in tp, pp or cp report the same number). Loops that do not fit a context manager call
``begin_step()`` and ``end_step(tokens)``. Collectives are counted per phase of the step: backward is detected,
and the trainer marks the rest, e.g. ``with monitor.phase("optimizer"): optimizer.step()`` (see
``trainer_hooks.collectives``); unmarked collectives of a step outside backward count as ``forward``.
``monitor.record_loss(loss)`` inside a step reports the step's loss with it. A pipeline stage reports its bubble
with each step: the time its
training thread waited on the pipeline's sends and receives (``trainer_hooks.collectives``); with
``monitor.watch_pipeline("1f1b", stages=4, microbatches=8)`` the schedule goes with it, for the theory it is
compared to. A rank of a fault-tolerant replica group (torchft, one world per group) says so once with
``watch_replica_group(group, groups)`` and reports each step's quorum with ``record_quorum(...)``. Nothing here
raises into training or blocks it: failures are counted (``internal_errors``) and logged once; undeliverable
reports are dropped and counted.

On CPU a step is timed on the host and reported at its end. On CUDA the monitor never waits for the device: the
step time is the time between CUDA events recorded at its start and end, the loss is copied to host memory without
blocking, and the step is reported once its events and its collectives' GPU durations are in, usually a step or two
later, still labelled with its own step (``trainer_hooks.deferred``). Memory peaks are the caching allocator's,
read at the end of the step.

A watchdog thread reports a rank that has waited on one collective for longer than ``collective_timeout_s``
(one ``collective_timeout`` message per wait, naming the dimension and the op): its peers are most likely stopped,
dead or slower, and the controller learns it before the run's hang timeout. The same thread runs the policy's
``dump_flight_recorder`` commands and dumps the Flight Recorder after a timeout (``trainer_hooks.flight``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from opsd.protocol.wire import (
    CLOSING,
    VERSION,
    Activity,
    CommEntry,
    Phase,
    PipelineReport,
    StepReport,
    encode,
)
from trainer_hooks.collectives import TRACER, CollectiveTracer, PhaseMark
from trainer_hooks.comm_tables import DIMENSIONS, FORWARD, OTHER, StepComms
from trainer_hooks.ddp import trace_buckets
from trainer_hooks.deferred import EventFactory, PendingStep, PendingSteps, cuda_event, stage_loss
from trainer_hooks.flight import FlightRecorder
from trainer_hooks.flops import ModelShape, mfu_ratio, peak_flops
from trainer_hooks.flops import flops_per_token as formula_flops_per_token
from trainer_hooks.monitor_config import MonitorConfig as MonitorConfig  # where users import it from
from trainer_hooks.notices import activity_report, timeout_report
from trainer_hooks.report_parts import ReportParts
from trainer_hooks.sinks import JsonlSink, Sink, agent_sink

log = logging.getLogger(__name__)

BATCH_DIMENSIONS = ("dp_replicate", "dp_shard", "ep")


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Monitor(ReportParts):
    def __init__(
        self,
        shape: ModelShape | None,
        config: MonitorConfig,
        *,
        coords: dict[str, int] | None = None,
        batch_shards: int = 1,
        device: torch.device | None = None,
        tracer: CollectiveTracer = TRACER,
        flops_per_token: float | None = None,
        events: EventFactory | None = None,
    ) -> None:
        """``flops_per_token`` overrides the formula of ``shape`` (e.g. the figure of ``measure_flops_per_token``
        taken once at start-up); with neither, MFU is reported as 0. ``events`` makes the events that time a step on
        its device (default: CUDA events on a CUDA device, none on CPU: host timing)."""
        self.config = config
        self.coords = dict(coords or {})
        self.batch_shards = batch_shards
        self.device = device or torch.device("cpu")
        self.tracer = tracer
        self.events = events if events is not None else (cuda_event if self.device.type == "cuda" else None)
        self.pending = PendingSteps(config.max_pending_steps, config.max_pending_s)
        self._begin_event: Any = None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.host = socket.gethostname()
        self.internal_errors = 0
        self.steps = 0
        self._init_parts()
        self.last_report: StepReport | None = None
        self._started: float | None = None
        self._loss: float | torch.Tensor | None = None
        self._warned = False
        if flops_per_token is not None:
            if not flops_per_token > 0:
                raise ValueError(f"monitor: flops_per_token must be > 0, got {flops_per_token!r}")
            self.flops_per_token = float(flops_per_token)
        else:
            self.flops_per_token = formula_flops_per_token(shape) if shape is not None else 0.0
        self.peak_flops_per_s = self._peak()
        self.sinks: list[Sink] = []
        agent = agent_sink(config.socket_path)  # its socket, else its UDP port at $OPSD_AGENT_HOST
        if agent is not None:
            self.sinks.append(agent)
        if config.jsonl_path:
            self.sinks.append(JsonlSink(config.jsonl_path))
        self._installed = config.trace_collectives and not tracer.installed  # then ``close`` uninstalls it
        if config.trace_collectives:
            tracer.install()
        self.timeouts_reported = 0
        self._closing = threading.Event()
        self.flight = FlightRecorder(
            config.run_id, self.rank, self.world_size, directory=config.flight_dir, tracer=tracer, host=self.host
        )
        if config.trace_collectives:
            watchdog = threading.Thread(target=self._watch, name="opsd-collective-watchdog", daemon=True)
            watchdog.start()

    def _watch(self) -> None:
        """Report each wait on a collective that outlasts ``collective_timeout_s``, once, and dump the Flight
        Recorder after it; run the policy's Flight Recorder commands (never raises)."""
        limit_s = self.config.collective_timeout_s
        reported = None
        while not self._closing.wait(min(1.0, limit_s / 4) if limit_s > 0 else 1.0):
            try:
                self.flight.poll()
                blocked = self.tracer.blocked()
                if limit_s <= 0 or blocked is None or blocked.waited_s < limit_s or blocked.since == reported:
                    continue
                reported = blocked.since
                self.timeouts_reported += 1
                run, host, waited_s = self.config.run_id, self.host, blocked.waited_s
                data = encode(timeout_report(run, self.rank, host, self.steps, blocked.dim, blocked.op, waited_s))
                for sink in self.sinks:
                    sink.send(data)
                self.flight.dump(f"timeout-{self.rank}-{self.steps}")
            except Exception as exc:
                self._error(exc)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, shape: ModelShape | None, config: MonitorConfig, **kwargs: Any) -> Monitor:
        """Label every named dimension of ``mesh`` with its name; coordinates and batch shards from the mesh."""
        names = mesh.mesh_dim_names or ()
        coordinate = list(mesh.get_coordinate() or [])
        sizes = dict(zip(names, mesh.shape, strict=True))
        tracer: CollectiveTracer = kwargs.get("tracer", TRACER)
        for name in names:
            if name in DIMENSIONS:
                tracer.label(mesh.get_group(name), name)
        batch_shards = 1
        for name in BATCH_DIMENSIONS:
            batch_shards *= sizes.get(name, 1)
        coords = dict(zip(names, coordinate, strict=False))
        if "device" not in kwargs:
            cuda = mesh.device_type == "cuda"
            kwargs["device"] = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return cls(shape, config, coords=coords, batch_shards=batch_shards, **kwargs)

    def label(self, group: dist.ProcessGroup, dimension: str) -> None:
        """Attribute ``group``'s collectives to ``dimension`` (for flattened or hand-made groups)."""
        self.tracer.label(group, dimension)

    def watch_ddp(self, model: DistributedDataParallel, dimension: str = "dp_replicate") -> None:
        """Make a DDP model's gradient all-reduces visible. DDP's reducer calls the backend from C++, out of the
        tracer's sight; this registers torch's reference ``allreduce_hook`` (the same averaging as DDP's built-in
        reduction) so the buckets are all-reduced through ``torch.distributed``, one at a time on gloo
        (``trainer_hooks.ddp``). Call before the first step."""
        self.label(model.process_group, dimension)
        trace_buckets(model)

    def phase(self, name: str) -> PhaseMark:
        """``with monitor.phase("optimizer"):`` the collectives issued inside count under that phase (``forward``,
        ``backward``, ``optimizer``, ``other``); a few hundred nanoseconds."""
        return self.tracer.phase(name)

    def record_loss(self, loss: float | torch.Tensor) -> None:
        """The loss to send with the step's report: inside a step, that step's. A tensor on the device is read once
        the step's work is done on it, never by waiting for it; a loss that is not a finite number is not sent."""
        self._loss = loss.detach() if isinstance(loss, torch.Tensor) else loss

    @property
    def dropped_reports(self) -> int:
        return sum(sink.dropped for sink in self.sinks)

    def _peak(self) -> float:
        try:
            name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else self.device.type
            return peak_flops(name, self.config.peak_flops_per_s, self.config.cpu_peak_flops_per_s)
        except Exception as exc:
            self._error(exc)
            return 0.0

    def _error(self, exc: BaseException) -> None:
        self.internal_errors += 1
        if not self._warned:
            self._warned = True
            log.warning("monitor failed (counted, not raised): %r", exc)

    def activity(self, what: Activity) -> None:
        """Tell the agent this rank stops stepping for a reason it knows (``"checkpoint"``: a save it waits for;
        ``"closing"``: its training loop is over), or trains again (``""``; its next step says so too): the
        controller judges no hang meanwhile (up to ``detection.busy_limit_s``). Never raises."""
        try:
            data = encode(activity_report(self.config.run_id, self.rank, self.host, what))
            for sink in self.sinks:
                if getattr(sink, "to_agent", True):  # a sink of the user's that does not say: taken as one
                    sink.send(data)
        except Exception as exc:
            self._error(exc)

    @contextlib.contextmanager
    def busy(self, what: Activity) -> Iterator[None]:
        """``activity(what)`` for the block, ``activity("")`` after it."""
        self.activity(what)
        try:
            yield
        finally:
            self.activity("")

    @contextlib.contextmanager
    def step(self, tokens: int) -> Iterator[None]:
        """The block is one step, reported at its end; a block that raises is no step (``abandon_step``)."""
        self.begin_step()
        try:
            yield
        except BaseException:
            self.abandon_step()
            raise
        self.end_step(tokens)

    def begin_step(self) -> None:
        self._started = time.perf_counter()
        self.tracer.default_phase = FORWARD
        try:
            self.tracer.take_step()  # collectives before the step (set-up, evaluation) are not the step's
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            self._begin_event = None
            if self.events is not None:
                self._begin_event = self.events()
                self._begin_event.record()
        except Exception as exc:
            self._error(exc)

    def abandon_step(self) -> None:
        """The step begun raised (a peer died in its collective, say): it did not happen, and is neither reported
        nor counted; its collectives so far are dropped."""
        try:
            self._started, self._begin_event, self._loss, self._quorum = None, None, None, None
            self.tracer.default_phase = OTHER
            self.tracer.take_step()
        except Exception as exc:
            self._error(exc)

    def end_step(self, tokens: int) -> None:
        """End the step; report it now if it is complete (on CPU), else once it is (``trainer_hooks.deferred``)."""
        try:
            if self._started is None:
                return
            host_s = time.perf_counter() - self._started
            self._started = None
            self.tracer.default_phase = OTHER
            self.steps += 1
            try:
                comms = self.tracer.take_step()
            except Exception as exc:  # the step is still reported, without its collectives
                self._error(exc)
                comms = StepComms()
            loss, self._loss = self._loss, None
            pending = PendingStep(self.steps, tokens, host_s, time.time(), comms, self._memory())
            pending.ended_s = time.monotonic()
            pending.quorum, self._quorum = self._quorum, None  # the step's, reported with it however late
            pending.begin, self._begin_event = self._begin_event, None
            if pending.begin is not None and self.events is not None:
                pending.loss = stage_loss(loss) if loss is not None else None
                pending.end = self.events()
                pending.end.record()
            else:
                pending.begin, pending.loss = None, loss
            self.pending.add(pending)
            self._send(self.pending.ready(pending.ended_s))
        except Exception as exc:
            self._error(exc)

    def _memory(self) -> dict[str, int]:
        if self.device.type == "cuda":  # the caching allocator's figures: kept on the host, no wait for the device
            return {
                "allocated_peak_bytes": torch.cuda.max_memory_allocated(self.device),
                "reserved_peak_bytes": torch.cuda.max_memory_reserved(self.device),
            }
        return {"rss_bytes": _rss_bytes()}

    def _send(self, steps: list[PendingStep]) -> None:
        for step in steps:
            try:
                report = self._report(step)
                self.last_report = report
                data = encode(report)
                for sink in self.sinks:
                    sink.send(data)
            except Exception as exc:
                self._error(exc)

    def flush(self, timeout_s: float | None = None) -> None:
        """Report every step still waiting: wait (up to ``timeout_s``, default ``close_wait_s``) for their
        collectives' durations and their events. Blocks: for the end of training, not inside it."""
        limit_s = self.config.close_wait_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit_s
        try:
            while len(self.pending) and time.monotonic() < deadline:
                self._send(self.pending.ready(time.monotonic()))
                if len(self.pending):
                    time.sleep(0.01)
            self._send(self.pending.drain())
        except Exception as exc:
            self._error(exc)

    def _report(self, pending: PendingStep) -> StepReport:
        comms, tokens = pending.comms, pending.tokens
        step_s = pending.step_s()
        exposed = min(comms.exposed_s, step_s)
        tokens_per_s = tokens / step_s if step_s > 0 else 0.0
        shards = self.batch_shards
        quorum = pending.quorum
        if quorum is not None and quorum.replica_groups > 0:  # the groups that trained in the step
            shards = shards // quorum.replica_groups * quorum.participants
        job_tokens_per_s = tokens_per_s * shards
        mfu = 0.0
        if self.peak_flops_per_s > 0 and self.flops_per_token > 0:
            mfu = mfu_ratio(job_tokens_per_s, self.flops_per_token, self.peak_flops_per_s * self.world_size)
        pipeline = None
        if self._pipeline is not None or comms.pipeline_transfers:
            bubble_s = min(comms.pipeline_wait_s, step_s)
            pipeline = msgspec.structs.replace(self._pipeline or PipelineReport(0.0), bubble_s=bubble_s)
        loss = None
        if pending.loss is not None:
            try:
                value = float(pending.loss)
                loss = value if math.isfinite(value) else None
            except Exception as exc:  # the step is still reported, without its loss
                self._error(exc)
        with self._checkpoints_lock:
            checkpoints, self._checkpoints = self._checkpoints, []
        return StepReport(
            v=VERSION,
            kind="step",
            run=self.config.run_id,
            rank=self.rank,
            world_size=self.world_size,
            host=self.host,
            step=pending.step,
            time_unix_s=pending.time_unix_s,
            step_s=step_s,
            compute_s=step_s - exposed,
            exposed_comm_s=exposed,
            overlapped_comm_s=max(comms.total_s - exposed, 0.0),
            tokens=tokens,
            tokens_per_s=tokens_per_s,
            job_tokens_per_s=job_tokens_per_s,
            mfu_ratio=mfu,
            memory=pending.memory,
            coords=dict(self.coords),
            # a copy: a step sent before all its GPU durations came may still receive one, on another thread
            comms=[
                CommEntry(dim, op, s.count, s.bytes, s.seconds, cast(Phase, phase))
                for (dim, op, phase), s in sorted(dict(comms.phases).items())
            ],
            dropped_reports_total=self.dropped_reports,
            internal_errors_total=self.internal_errors + self.tracer.internal_errors + self.pending.incomplete,
            checkpoints=checkpoints,
            loss=loss,
            resumed_from_step=self.resumed_from_step,
            pipeline=pipeline,
            launch=self.config.launch,
            ft=quorum,
            comm_timing_fallbacks_total=self.tracer.timing_fallbacks,
            comm_host_timed_s=sum(s.seconds for s in list(comms.phases.values()) if s.host_timed),
            checkpoints_skipped_total=self.checkpoints_skipped,
        )

    def close(self) -> None:
        """Report the steps still waiting (``flush``), say the rank ends (``activity("closing")``: what it does
        before it exits is no hang), stop the watchdog, close the sinks, and take the tracer out of
        ``torch.distributed`` if this monitor put it there."""
        self.flush()
        self.activity(CLOSING)
        self._closing.set()
        for sink in self.sinks:
            sink.close()
        if self._installed:
            self.tracer.uninstall()
