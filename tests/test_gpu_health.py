"""GPU health through the file-backed fake source (no GPU here), XID counting and decisions, and the metrics.

``FileGpuSource`` stands in for NVML at the ``GpuSource`` interface; ``NvmlSource``, the adapter over nvidia-ml-py,
is tested against a fake ``pynvml`` module (tests/fake_nvml.py: no NVML library here), and against the real NVML
where there is one."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from opsd.errors import PermanentError
from opsd.policy.xid import WatchWindow
from opsd.protocol.gpu_files import GpuSample, inject_xid, write_samples
from opsd.protocol.xid_table import load_xid_table
from opsd_agent.daemon import Agent, AgentConfig
from opsd_agent.gpu import FileGpuSource, NvmlSource, open_source
from opsd_agent.health import GpuHealth, GpuHealthCollector
from tests.fake_nvml import CONSTANTS, ERRORS, FUNCTIONS, EventData, FakeGpu, FakeNvml
from tests.test_agent import samples, samples_of
from tests.waiting import wait_for

SAMPLE = GpuSample(
    index=0,
    uuid="GPU-0",
    temperature_c=71.0,
    sm_clock_hz=1.98e9,
    power_w=690.5,
    clock_event_reasons=4,
    ecc_volatile_corrected=3,
    ecc_aggregate_corrected=12,
    retired_pages_sbe=2,
    remapped_rows_correctable=1,
    row_remap_pending=True,
    nvlink_errors=5,
)


def health(tmp_path: Path, threshold: int = 1) -> GpuHealth:
    source = FileGpuSource(tmp_path)
    return GpuHealth(source, load_xid_table(), WatchWindow(window_s=60, threshold=threshold), interval_s=0.05)


def test_fake_source_reads_samples_and_only_new_xids(tmp_path: Path) -> None:
    inject_xid(tmp_path, 0, 13)  # before the source opened: not reported
    source = FileGpuSource(tmp_path)
    write_samples(tmp_path, [SAMPLE, GpuSample(index=1, uuid="GPU-1")])
    assert source.sample()[0] == SAMPLE
    assert source.xid_events(0) == []
    inject_xid(tmp_path, 1, 79)
    (tmp_path / "xids.jsonl").open("a").write('{"gpu": "x"}\n{"gpu": 0, "xid": 92}\n{"gpu": 0')  # bad, good, partial
    assert source.xid_events(0) == [(1, 79), (0, 92)]
    assert source.bad_lines == 1
    with (tmp_path / "xids.jsonl").open("a") as f:
        f.write(', "xid": 94}\n')  # the partial line, completed
    assert source.xid_events(1.0) == [(0, 94)]


def test_xids_are_counters_and_fatal_ones_become_pending_events(tmp_path: Path) -> None:
    h = health(tmp_path)
    assert h.record(0, 92, now_s=0).action == "count"
    assert h.record(0, 92, now_s=10).action == "cordon_and_swap"  # 2 > threshold 1 within 60 s
    assert h.record(1, 79, now_s=20).action == "cordon_and_swap"
    assert h.record(1, 13, now_s=30).action == "restart_job"
    assert h.xid_counts == {(0, 92): 2, (1, 79): 1, (1, 13): 1}
    pending = h.pending_events()
    assert [(e.gpu, e.xid, e.action) for e in pending] == [
        (0, 92, "cordon_and_swap"),
        (1, 79, "cordon_and_swap"),
        (1, 13, "restart_job"),
    ]
    h.acknowledge(pending[1].seq)
    assert [e.xid for e in h.pending_events()] == [13]


def test_a_broken_source_is_counted_and_polling_goes_on(tmp_path: Path) -> None:
    h = health(tmp_path)
    (tmp_path / "gpus.json").write_text("{not json")
    h.poll_once(0)
    assert h.source_errors == 1
    write_samples(tmp_path, [SAMPLE])
    h.poll_once(0)
    assert h.samples == [SAMPLE]


def start_file_agent(tmp_path: Path, node: str = "n") -> tuple[Agent, Path]:
    """A started agent on the fake GPU source in ``tmp_path/gpus``, sampling every 50 ms."""
    gpus = tmp_path / "gpus"
    config = AgentConfig(
        socket=str(tmp_path / "a.sock"), metrics_port=0, node=node, gpu_source=f"file:{gpus}", gpu_interval_s=0.05
    )
    agent = Agent(config)
    agent.start()
    return agent, gpus


def xids_seen(agent: Agent) -> int:
    """How many XID events the agent has counted so far."""
    return 0 if agent.gpu is None else sum(agent.gpu.xid_counts.values())


def test_agent_exports_gpu_health_and_injected_xids(tmp_path: Path) -> None:
    agent, gpus = start_file_agent(tmp_path)
    write_samples(gpus, [SAMPLE])
    try:
        inject_xid(gpus, 0, 79)
        inject_xid(gpus, 0, 79)
        wait_for("both injected XIDs at the agent", lambda: xids_seen(agent) >= 2, 10)
        wait_for("sample of the new gpus.json", lambda: agent.gpu is not None and agent.gpu.samples == [SAMPLE], 10)
        m = samples(agent)
    finally:
        agent.stop()
    assert m[("opsd_gpu_xid_errors_total", (("gpu", "0"), ("xid", "79")))] == 2
    assert m[("opsd_gpu_health_actions_total", (("action", "cordon_and_swap"), ("gpu", "0")))] == 2
    assert m[("opsd_gpu_temperature_celsius", (("gpu", "0"),))] == 71.0
    assert m[("opsd_gpu_power_watts", (("gpu", "0"),))] == 690.5
    assert m[("opsd_gpu_row_remap_pending", (("gpu", "0"),))] == 1
    assert m[("opsd_gpu_ecc_errors_total", (("gpu", "0"), ("scope", "aggregate"), ("type", "corrected")))] == 12
    assert m[("opsd_gpu_retired_pages", (("cause", "single_bit"), ("gpu", "0")))] == 2
    assert m[("opsd_gpu_nvlink_errors_total", (("gpu", "0"),))] == 5
    per_gpu = [k for k in m if k[0].startswith("opsd_gpu_") and ("gpu", "0") in k[1] and "xid" not in k[0]]
    per_gpu = [k for k in per_gpu if "health_actions" not in k[0]]
    assert len(per_gpu) == 14  # the documented fixed part of the per-GPU budget


def nvml(monkeypatch: pytest.MonkeyPatch, fake: FakeNvml) -> FakeNvml:
    """``import pynvml`` gives the fake's module for this test."""
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    return fake


def test_nvml_source_reads_each_gpu_in_base_units(monkeypatch: pytest.MonkeyPatch) -> None:
    sbe, dbe = 0, 1  # NVML's page retirement causes
    full = FakeGpu(
        uuid="GPU-3b1c",
        temperature_c=71,
        sm_clock_mhz=1980,
        power_mw=690_500,
        clocks_event_reasons=4,
        ecc={(0, 0): 3, (1, 0): 1, (0, 1): 12, (1, 1): 2},  # (corrected | uncorrected, volatile | aggregate)
        retired_pages={sbe: [0x1000, 0x2000], dbe: [0x3000]},
        remapped_rows=(5, 1, 1, 0),
        nvlink_errors={(0, 0): 2, (0, 3): 1, (5, 1): 4},  # (link, DL counter)
    )
    bare = FakeGpu(  # no NVLink, no ECC, no row remapping, an older driver's clock reasons
        uuid="GPU-9d0e",
        unsupported={"nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRetiredPages", "nvmlDeviceGetRemappedRows"},
    )
    fake = nvml(monkeypatch, FakeNvml([full, bare]))
    source = NvmlSource()
    first, second = source.sample()
    assert first == GpuSample(
        index=0,
        uuid="GPU-3b1c",
        temperature_c=71.0,
        sm_clock_hz=1.98e9,
        power_w=690.5,
        clock_event_reasons=4,
        ecc_volatile_corrected=3,
        ecc_volatile_uncorrected=1,
        ecc_aggregate_corrected=12,
        ecc_aggregate_uncorrected=2,
        retired_pages_sbe=2,
        retired_pages_dbe=1,
        remapped_rows_correctable=5,
        remapped_rows_uncorrectable=1,
        row_remap_pending=True,
        nvlink_errors=7,
    )
    unsupported = dict.fromkeys(
        (
            "ecc_volatile_corrected",
            "ecc_volatile_uncorrected",
            "ecc_aggregate_corrected",
            "ecc_aggregate_uncorrected",
            "retired_pages_sbe",
            "retired_pages_dbe",
            "remapped_rows_correctable",
            "remapped_rows_uncorrectable",
            "row_remap_pending",
            "nvlink_errors",
        )
    )
    assert second == GpuSample(
        index=1, uuid="GPU-9d0e", temperature_c=40.0, sm_clock_hz=1.98e9, power_w=300.0, **unsupported
    )
    source.close()
    assert (fake.initialised, fake.freed) == (False, [1])


def test_fields_nvml_does_not_support_are_not_exported_but_counted_and_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # what an H100 answered: no NVLink counters exposed, no page retirement (it remaps rows); the rest reads
    h100 = FakeGpu(
        uuid="GPU-e1f2",
        temperature_c=50,
        ecc={(0, 0): 0, (1, 0): 0, (0, 1): 0, (1, 1): 0},
        unsupported={"nvmlDeviceGetNvLinkErrorCounter", "nvmlDeviceGetRetiredPages"},
    )
    fake = nvml(monkeypatch, FakeNvml([h100, FakeGpu("GPU-f00d", nvlink_errors={(0, 0): 3})]))
    source = NvmlSource()
    with caplog.at_level(logging.WARNING, logger="opsd_agent.gpu"):
        first, second = source.sample()
        source.sample()
    assert (first.nvlink_errors, first.retired_pages_sbe, first.retired_pages_dbe) == (None, None, None)
    assert (first.ecc_aggregate_uncorrected, first.remapped_rows_uncorrectable) == (0, 0)  # supported: a real 0
    assert (second.nvlink_errors, second.retired_pages_sbe) == (3, 0)
    assert source.field_errors == {(0, "nvlink_errors"): 2, (0, "retired_pages_sbe"): 2, (0, "retired_pages_dbe"): 2}
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2  # once per NVML call, however many samples and fields
    assert any("nvmlDeviceGetNvLinkErrorCounter" in line and "Not Supported" in line for line in logged)
    health = GpuHealth(source, load_xid_table(), WatchWindow())
    health.poll_once(0.0)
    registry = CollectorRegistry()
    registry.register(GpuHealthCollector(health, "n1"))
    m = samples_of(generate_latest(registry).decode())
    assert ("opsd_gpu_nvlink_errors_total", (("gpu", "0"),)) not in m  # not "no errors": no sample at all
    assert ("opsd_gpu_retired_pages", (("cause", "single_bit"), ("gpu", "0"))) not in m
    assert m[("opsd_gpu_nvlink_errors_total", (("gpu", "1"),))] == 3
    assert m[("opsd_gpu_ecc_errors_total", (("gpu", "0"), ("scope", "aggregate"), ("type", "uncorrected")))] == 0
    assert m[("opsd_gpu_field_errors_total", (("field", "nvlink_errors"), ("gpu", "0")))] == 3
    assert m[("opsd_gpu_field_errors_total", (("field", "retired_pages_dbe"), ("gpu", "0")))] == 3
    assert fake.initialised


def test_nvml_source_falls_back_on_throttle_reasons_of_an_older_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGpu(uuid="GPU-0", clocks_event_reasons=0x20)
    nvml(monkeypatch, FakeNvml([gpu], missing=frozenset({"nvmlDeviceGetCurrentClocksEventReasons"})))
    (sample,) = NvmlSource().sample()
    assert sample.clock_event_reasons == 0x20


def test_nvml_source_reports_the_xids_of_each_gpu_by_index(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = nvml(monkeypatch, FakeNvml([FakeGpu("GPU-0"), FakeGpu("GPU-1"), FakeGpu("GPU-2")]))
    source = NvmlSource()
    assert source.xid_events(0.01) == []
    fake.xid(2, 79)
    fake.xid(0, 48)
    assert source.xid_events(0.01) == [(2, 79), (0, 48)]  # all that is there, in order
    assert source.xid_events(0.01) == []


def test_a_gpu_without_xid_events_is_still_sampled(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = nvml(monkeypatch, FakeNvml([FakeGpu("GPU-0", unsupported={"nvmlDeviceRegisterEvents"}), FakeGpu("GPU-1")]))
    source = NvmlSource()
    fake.xid(0, 79)  # never delivered: GPU 0 could not be registered
    fake.xid(1, 31)
    assert source.xid_events(0.01) == [(1, 31)]
    assert [s.uuid for s in source.sample()] == ["GPU-0", "GPU-1"]


def test_a_machine_without_nvml_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml(monkeypatch, FakeNvml([], library=False))
    with pytest.raises(PermanentError, match=r"^NVML is not available: NVML Shared Library Not Found$"):
        NvmlSource()


def test_the_fake_nvml_has_the_real_modules_names_and_values() -> None:
    """The fake's constants, error codes and functions are those of the installed nvidia-ml-py."""
    import pynvml  # type: ignore[import-untyped]

    assert {name: getattr(pynvml, name) for name in CONSTANTS} == CONSTANTS
    assert {name: getattr(pynvml, name)().value for name in ERRORS} == {k: code for k, (code, _) in ERRORS.items()}
    assert {name: str(getattr(pynvml, name)()) for name in ERRORS} == {k: text for k, (_, text) in ERRORS.items()}
    assert [name for name in FUNCTIONS if not callable(getattr(pynvml, name, None))] == []
    assert [f[0] for f in pynvml.c_nvmlEventData_t._fields_] == [f[0] for f in EventData._fields_]


def test_nvml_source_on_this_machines_gpus() -> None:
    """The real NVML, where there is one: every GPU gives a sample."""
    try:
        source = NvmlSource()
    except PermanentError as exc:
        pytest.skip(f"no NVML on this machine ({exc}); the adapter is tested against tests/fake_nvml.py")
    try:
        samples = source.sample()
        assert [s.index for s in samples] == list(range(len(samples)))
        assert all(s.uuid.startswith("GPU-") for s in samples)
    finally:
        source.close()


@pytest.mark.parametrize("spec", ["cuda", "file:", ""])
def test_bad_gpu_source_spec(spec: str) -> None:
    with pytest.raises(PermanentError, match="expected nvml, none or file:DIRECTORY"):
        open_source(spec)
