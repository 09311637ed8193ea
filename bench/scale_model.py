"""From the costs measured on this project's runs (``bench.measured_costs``: 4 CPU ranks, 2 nodes) to those of a
large job: which parts grow with the job, with what, and why (also in docs/simulation.md, "Costs").

- Blocking save. Staging copies the rank's shard into memory: x the slowest rank's bytes over a rank's bytes here,
  at the rate measured here (a CPU copy on 2 shared cores; a GPU's copy to pinned host memory is faster, so this
  overstates it). The rest is torch DCP planning the save together (every rank's plan gathered on one rank, the
  global plan sent back): x log2 of the ranks over log2 of the ranks here, the depth of those collectives (the
  coordinator's own work grows with the ranks: not measured here).
- Durable after (the upload): every rank writes its shard at once, until the storage is the bottleneck:
  max(the slowest rank's bytes / one rank's write rate here, all bytes / the storage's bandwidth).
- Detection of an XID: the agent reads NVML on its node and reports with its next heartbeat; nothing grows with the
  nodes (the controller's p99 heartbeat latency is 14 ms at 1,536 nodes, ``bench.controller_scale``). The demo's
  agents sample GPUs every 0.2 s, a production agent every 5 s: the mean wait for a sample (half the interval) is
  swapped. Heartbeats stopping, hangs and exits: the defaults of ``DetectionConfig`` (configured, not measured).
- Relaunch. The controller's steps (cordon, spare, stop, launch) act on the nodes concerned, in parallel: kept. The
  ranks' start-up (process start, ``import torch``, model build) happens on every node at once: kept (4 ranks on 2
  shared cores here). Setting up the communicators grows with the ranks, and gloo on 4 ranks says nothing of NCCL
  on 16,384: ``Job.communicator_init_s`` is added, an assumption (MegaScale, NSDI 2024: under 30 s past 10,000
  GPUs once optimised). The restore reads every rank's shard back at the rate it was written: as the upload.

Not modelled: a Kubernetes relaunch's pod scheduling and container start on the spare (its image is already there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.measured_costs import Measured
from opsd.analysis.presets import DETECTION, Detection
from opsd.analysis.simulation import Costs
from opsd.backends.local.spec import LocalRunSpec
from opsd.policy.detection import DetectionConfig
from opsd_agent.daemon import AgentConfig


@dataclass(frozen=True)
class Job:
    """The job the costs are scaled to; the defaults are Llama 3 405B's pretraining (sources inline)."""

    gpus: int = 16384
    #: fp32 weights and AdamW's two moments, 12 bytes a parameter: what the reference trainer's checkpoint (and
    #: bench.checkpoint_stall's) holds
    checkpoint_bytes: float = 405e9 * 12
    #: Llama 3 (section 3.3.4): each GPU's model state is 1 MB to 4 GB; a save waits for its slowest rank
    slowest_rank_bytes: float = 4e9
    #: Llama 3 (section 3.3.1): Tectonic sustains 2 TB/s (7 TB/s at peak)
    storage_bytes_per_s: float = 2e12
    #: assumed (module docstring): setting up the communicators of 16,384 ranks
    communicator_init_s: float = 30.0
    step_time_s: float = 5.0
    repair_h: float = 24.0

    def __post_init__(self) -> None:
        if self.gpus < 2:
            raise ValueError("job.gpus must be >= 2")
        for name in ("checkpoint_bytes", "slowest_rank_bytes", "storage_bytes_per_s", "step_time_s", "repair_h"):
            if not getattr(self, name) > 0:
                raise ValueError(f"job.{name} must be > 0")
        if self.communicator_init_s < 0:
            raise ValueError("job.communicator_init_s must be >= 0")


@dataclass(frozen=True)
class Part:
    cost: str
    part: str
    here_s: float | None  # None: nothing measured here
    at_scale_s: float
    rule: str  # how it grows


@dataclass(frozen=True)
class Scaled:
    costs: Costs
    detection: Detection
    parts: tuple[Part, ...]


def scale(measured: Measured, job: Job) -> Scaled:
    """The measured costs at ``job``'s size (the module docstring gives the model)."""
    bytes_ratio = job.slowest_rank_bytes / measured.bytes_per_rank
    depth_ratio = math.log2(job.gpus) / math.log2(max(2, measured.checkpoint_ranks))
    staging = measured.async_staging_s * bytes_ratio
    planning_here = measured.async_blocking_s - measured.async_staging_s
    planning = planning_here * depth_ratio
    per_rank = job.slowest_rank_bytes / measured.write_bytes_per_s_per_rank
    storage = job.checkpoint_bytes / job.storage_bytes_per_s
    transfer = max(per_rank, storage)
    transfer_rule = (
        f"max({job.slowest_rank_bytes / 1e9:g} GB / {measured.write_bytes_per_s_per_rank / 1e6:.0f} MB/s a rank, "
        f"{job.checkpoint_bytes / 1e12:.2f} TB / {job.storage_bytes_per_s / 1e12:g} TB/s)"
    )
    local_wait = LocalRunSpec.gpu_interval_s / 2  # the mean wait for the agent's next GPU sample
    production_wait = AgentConfig.gpu_interval_s / 2
    xid = max(production_wait, measured.xid_detection_s - local_wait + production_wait)
    config = DetectionConfig()
    heartbeat_s = AgentConfig.heartbeat_interval_s
    defaults = DETECTION["opsd"]
    detection = Detection(
        xid_s=xid,
        node_lost_s=max(config.heartbeat_factor * heartbeat_s, config.heartbeat_floor_s),
        exit_s=defaults.exit_s,
        hang_s=max(config.hang_factor * job.step_time_s, config.hang_floor_s),
    )
    restart = measured.controller_steps_s + measured.rank_startup_s + job.communicator_init_s + transfer
    parts = (
        Part("blocking save", "staging", measured.async_staging_s, staging, f"x{bytes_ratio:.1f}: bytes of a rank"),
        Part("blocking save", "the rest", planning_here, planning, f"x{depth_ratio:.1f}: log2 of the ranks"),
        Part("durable after", "upload", measured.sync_blocking_s, transfer, transfer_rule),
        Part(
            "detection",
            "XID",
            measured.xid_detection_s,
            xid,
            f"GPU sampled every {AgentConfig.gpu_interval_s:g} s, not {LocalRunSpec.gpu_interval_s:g} s",
        ),
        Part("relaunch", "controller's steps", measured.controller_steps_s, measured.controller_steps_s, "kept"),
        Part("relaunch", "ranks' start-up", measured.rank_startup_s, measured.rank_startup_s, "kept"),
        Part("relaunch", "communicator set-up", None, job.communicator_init_s, "assumed (MegaScale)"),
        Part("relaunch", "restore", None, transfer, "as the upload"),
    )
    costs = Costs(
        checkpoint_blocking_s=staging + planning,
        checkpoint_background_s=transfer,
        restart_s=restart,
        repair_h=job.repair_h,
        step_time_s=job.step_time_s,
    )
    return Scaled(costs, detection, parts)
