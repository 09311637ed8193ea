"""In-process hooks of a training rank: step telemetry and checkpoints. The only part of opsd that imports torch.

The public API::

    from trainer_hooks import Monitor, MonitorConfig, ModelShape

``Monitor`` (``monitor.step(tokens=...)`` or ``begin_step()`` / ``end_step(tokens)``), ``MonitorConfig``,
``ModelShape`` and ``shape_from_module`` (the model description for MFU), ``measure_flops_per_token`` (the measured
alternative), ``TRACER`` (the process-wide collective tracer, for labelling hand-made process groups).
"""

from trainer_hooks.collectives import TRACER
from trainer_hooks.comm_tables import DIMENSIONS
from trainer_hooks.flops import ModelShape, flops_per_token, measure_flops_per_token, shape_from_module
from trainer_hooks.monitor import Monitor, MonitorConfig

__all__ = [
    "DIMENSIONS",
    "TRACER",
    "ModelShape",
    "Monitor",
    "MonitorConfig",
    "flops_per_token",
    "measure_flops_per_token",
    "shape_from_module",
]
