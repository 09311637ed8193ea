"""The controller's configuration: every knob of detection, straggler scoring, cadence, spares and recovery."""

from __future__ import annotations

from dataclasses import dataclass, field

from opsd.policy.cadence import CadenceConfig
from opsd.policy.detection import DetectionConfig
from opsd.policy.pipeline import PipelineConfig
from opsd.policy.stragglers import StragglerConfig
from opsd.policy.telemetry import TelemetryConfig


@dataclass(frozen=True)
class ControllerConfig:
    detection: DetectionConfig = field(default_factory=DetectionConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    cadence: CadenceConfig = field(default_factory=CadenceConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)  # the bubble alert's margin over the theory
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)  # how often agents send their ranks
    liveness_max_skew_s: float = 30.0  # a liveness datagram whose sender's clock is further off is refused
    sample_slot_s: float = 2.0  # compute samples of ranks are compared within slots of this length
    history: int = 64  # heartbeat intervals and step times kept per node / rank
    run_history: int = 4096  # step times kept per run, of any rank: its median step time is theirs
    restart_lead_s: float = 5.0  # a graceful restart's checkpoint is asked for this far ahead of the newest step
    restart_min_lead_steps: int = 3
    restart_checkpoint_wait_s: float = 120.0  # how long a graceful restart waits for its checkpoint to commit
    spare_window_h: float = 24.0  # how long a failed node stays out (repair): the spare pool covers this window
    spare_risk: float = 0.01  # accepted chance that more nodes fail within the window than there are spares
    flight_wait_s: float = 10.0  # how long a hang's recovery waits for the ranks' Flight Recorder dumps
    hang_quarantine_after: int = 2  # a node the dumps blame for this many hangs in hang_window_h is swapped (0: no)
    hang_window_h: float = 24.0
    step_attempts: int = 5  # a recovery step that fails transiently is tried this many times in all
    step_retry_max_s: float = 30.0  # the longest wait between two attempts of a step
    step_timeout_s: float = 600.0  # how long a step under way (a cluster restarting a job) is waited for
    forget_finished_s: float = 3600.0  # a finished run's memory (its ranks, cadence) is kept this long for reads
    dry_run: bool = False  # detect, decide and record every recovery step it would take, and take none
    barren_launches: int = 3  # failures in a row whose relaunch made no step: the run fails, not relaunched (0: never)

    def __post_init__(self) -> None:
        if self.sample_slot_s <= 0:
            raise ValueError("controller.sample_slot_s must be > 0")
        if self.liveness_max_skew_s <= 0:
            raise ValueError("controller.liveness_max_skew_s must be > 0")
        if self.history < 2 or self.run_history < 2:
            raise ValueError("controller.history and controller.run_history must be >= 2")
        if self.restart_lead_s < 0 or self.restart_min_lead_steps < 1 or self.restart_checkpoint_wait_s < 0:
            raise ValueError("controller.restart_lead_s, restart_checkpoint_wait_s must be >= 0, min lead steps >= 1")
        if self.flight_wait_s < 0:
            raise ValueError("controller.flight_wait_s must be >= 0")
        if self.hang_quarantine_after < 0 or self.hang_window_h <= 0:
            raise ValueError("controller.hang_quarantine_after must be >= 0 and controller.hang_window_h > 0")
        if self.spare_window_h <= 0 or not 0 < self.spare_risk < 1:
            raise ValueError("controller.spare_window_h must be > 0 and controller.spare_risk between 0 and 1")
        if self.forget_finished_s < 0:
            raise ValueError("controller.forget_finished_s must be >= 0")
        if self.barren_launches < 0:
            raise ValueError("controller.barren_launches must be >= 0")
        if self.step_attempts < 1 or self.step_retry_max_s < 0 or self.step_timeout_s <= 0:
            raise ValueError("controller.step_attempts must be >= 1, step_retry_max_s >= 0 and step_timeout_s > 0")
