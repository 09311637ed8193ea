"""The settings object of `opsd serve`, `opsd run` and `opsd agent` (docs/configuration.md): file, environment and
flags in that order of precedence, errors that name the key, and frozen lists of keys and flags."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from pathlib import Path
from typing import Any

import pytest
import typer.main

from opsd.backends.local.processes import free_port
from opsd.cli import settings
from opsd.cli.app import app
from opsd.errors import ConfigError
from opsd.runtime.config import ServeConfig
from opsd_agent.daemon import AgentConfig
from tests.launch import ROOT, agent_until_sigterm

#: every key of the settings file; a change here is a change users see (docs/configuration.md, the Helm chart)
FROZEN_KEYS = [
    "controller.host",
    "controller.port",
    "controller.state_dir",
    "controller.state_url",
    "controller.token",
    "controller.reader_token",
    "controller.agent_token",
    "controller.metrics_token",
    "controller.previous_token",
    "controller.previous_reader_token",
    "controller.previous_agent_token",
    "controller.previous_metrics_token",
    "controller.tls_certfile",
    "controller.tls_keyfile",
    "controller.tls_reload_every_s",
    "controller.tick_interval_s",
    "controller.liveness_port",
    "controller.heartbeat_port",
    "controller.keep_alive_s",
    "controller.detection.heartbeat_factor",
    "controller.detection.heartbeat_floor_s",
    "controller.detection.hang_factor",
    "controller.detection.hang_floor_s",
    "controller.detection.witness_margin_s",
    "controller.detection.busy_limit_s",
    "controller.detection.peer_wait_s",
    "controller.stragglers.threshold_ratio",
    "controller.stragglers.window",
    "controller.stragglers.min_samples",
    "controller.stragglers.persistence_ratio",
    "controller.stragglers.swap_margin",
    "controller.cadence.prior_mtbf_node_h",
    "controller.cadence.prior_node_hours",
    "controller.cadence.min_interval_s",
    "controller.cadence.max_interval_s",
    "controller.cadence.lead_s",
    "controller.cadence.min_lead_steps",
    "controller.cadence.change_ratio",
    "controller.pipeline.margin_ratio",
    "controller.telemetry.heartbeats_per_s",
    "controller.telemetry.min_interval_s",
    "controller.telemetry.max_interval_s",
    "controller.telemetry.hysteresis_ratio",
    "controller.liveness_max_skew_s",
    "controller.sample_slot_s",
    "controller.history",
    "controller.run_history",
    "controller.restart_lead_s",
    "controller.restart_min_lead_steps",
    "controller.restart_checkpoint_wait_s",
    "controller.spare_window_h",
    "controller.spare_risk",
    "controller.flight_wait_s",
    "controller.hang_quarantine_after",
    "controller.hang_window_h",
    "controller.step_attempts",
    "controller.step_retry_max_s",
    "controller.step_timeout_s",
    "controller.forget_finished_s",
    "controller.dry_run",
    "controller.barren_launches",
    "controller.backend",
    "controller.kubernetes.namespace",
    "controller.kubernetes.watch_namespace",
    "controller.kubernetes.node_selector",
    "controller.kubernetes.kubeconfig",
    "controller.kubernetes.context",
    "controller.kubernetes.leader_election",
    "controller.kubernetes.lease_name",
    "controller.kubernetes.lease_duration_s",
    "controller.kubernetes.renew_deadline_s",
    "controller.kubernetes.retry_period_s",
    "controller.kubernetes.pod_name",
    "controller.kubernetes.quarantines_per_hour",
    "controller.kubernetes.force_delete_after_s",
    "controller.kubernetes.resync_interval_s",
    "controller.kubernetes.watch_timeout_s",
    "controller.kubernetes.rank_secret",
    "agent.socket",
    "agent.metrics_host",
    "agent.metrics_port",
    "agent.metrics_token",
    "agent.previous_metrics_token",
    "agent.datagram_host",
    "agent.datagram_port",
    "agent.node",
    "agent.receive_buffer_bytes",
    "agent.stale_after_s",
    "agent.quiet_after_s",
    "agent.max_comm_series",
    "agent.gpu_source",
    "agent.gpu_interval_s",
    "agent.gpu_retry_s",
    "agent.xid_table",
    "agent.xid_window_s",
    "agent.xid_threshold",
    "agent.controller_url",
    "agent.controller_token",
    "agent.heartbeat_interval_s",
    "agent.liveness_datagrams",
    "agent.policy_file",
    "agent.flight_dir",
    "agent.rank_secret",
    "agent.rank_auth",
]

CONNECTION = ["--config", "--state-dir", "--state-url", "--token", "--url"]
#: every command's flags (--help aside); a change here is a change users see (docs/cli.md)
FROZEN_FLAGS = {
    "version": [],
    "agent": [
        "--config",
        "--controller-token",
        "--controller-url",
        "--flight-dir",
        "--gpu-interval-s",
        "--gpu-source",
        "--heartbeat-interval-s",
        "--log-level",
        "--metrics-host",
        "--metrics-port",
        "--node",
        "--policy-file",
        "--socket",
        "--xid-table",
    ],
    "serve": [
        "--backend",
        "--config",
        "--dry-run",
        "--hang-floor-s",
        "--heartbeat-floor-s",
        "--host",
        "--log-level",
        "--port",
        "--state-dir",
        "--state-url",
        "--tick-interval-s",
        "--token",
    ],
    "run": [
        "--checkpoint-url",
        "--config",
        "--crash-after-action",
        "--gpus-per-node",
        "--hang-floor-s",
        "--heartbeat-floor-s",
        "--host",
        "--log-level",
        "--min-nodes",
        "--min-replicas",
        "--nodes",
        "--on-no-spare",
        "--port",
        "--replica-groups",
        "--run",
        "--spares",
        "--state-dir",
        "--token",
    ],
    "runs": ["--json", "--wide", *CONNECTION],
    "runs attach": ["--json", "--name", *CONNECTION],
    "status": ["--json", "--wide", *CONNECTION],
    "incidents": ["--json", "--wide", *CONNECTION],
    "restart": ["--json", "--no-wait", "--reason", "--timeout-s", "--wait", *CONNECTION],
    "cordon": ["--reason", *CONNECTION],
    "uncordon": [*CONNECTION],
    "spares": ["--json", "--wide", *CONNECTION],
    "checkpoints": ["--json", "--wide", *CONNECTION],
    "cadence": ["--json", "--wide", *CONNECTION],
    "postmortem": ["--format", "--json", "--out", *CONNECTION],
    "flamegraph": ["--folded", "--json", "--launch", "--out", *CONNECTION],
    "inject xid": ["--gpu", "--node", "--run", "--xid", *CONNECTION],
    "inject kill": ["--rank", "--run", *CONNECTION],
    "inject hang": ["--rank", "--run", *CONNECTION],
    "inject slow": ["--factor", "--rank", "--run", *CONNECTION],
    "drill xid": ["--gpu", "--json", "--node", "--xid", *CONNECTION],
    "maintenance start": ["--reason", "--run", *CONNECTION],
    "maintenance stop": ["--run", *CONNECTION],
    "maintenance list": ["--json", *CONNECTION],
    "simulate": [
        "--checkpoint-background-s",
        "--checkpoint-blocking-s",
        "--collective-timeout-s",
        "--communicator-rebuild-s",
        "--days",
        "--detection",
        "--failures-per-day",
        "--gpus",
        "--gpus-per-node",
        "--heal-s",
        "--heal-transfer-s",
        "--interval",
        "--json",
        "--min-replicas",
        "--mix",
        "--no-survivors-told",
        "--no-swap-stragglers",
        "--plot",
        "--preset",
        "--quorum-stall-s",
        "--repair-h",
        "--replica-groups",
        "--replicas",
        "--restart-s",
        "--seed",
        "--signal-s",
        "--spare-risk",
        "--spares",
        "--step-time-s",
        "--straggler-duration-h",
        "--straggler-episodes-per-day",
        "--straggler-slowdown",
        "--survivors-told",
        "--swap-stragglers",
        "--sweep-points",
    ],
    "plan": [
        "--checkpointing",
        "--gpu-memory-gb",
        "--json",
        "--micro-batch-size",
        "--micro-batches",
        "--no-sequence-parallel",
        "--seq-len",
        "--sequence-parallel",
        "--sharding",
    ],
    "dashboards push": ["--dir", "--folder", "--grafana-url", "--timeout-s", "--token"],
}


def flags_of(group: Any, prefix: str = "") -> dict[str, list[str]]:
    """Every command's long options: typer's commands (typer vendors its own click), groups recursed into."""
    out: dict[str, list[str]] = {}
    for name, command in group.commands.items():
        full = f"{prefix}{name}"
        if hasattr(command, "commands"):
            out.update(flags_of(command, f"{full} "))
            if not any(o.startswith("--") and o != "--help" for p in command.params for o in p.opts):
                continue  # a group without options of its own
        opts = [o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]
        out[full] = sorted(o for o in opts if o != "--help")
    return out


def test_the_keys_are_frozen() -> None:
    assert [k.path for s in settings.SECTIONS for k in settings.keys(s)] == FROZEN_KEYS


def test_the_flags_are_frozen() -> None:
    assert flags_of(typer.main.get_command(app)) == {k: sorted(v) for k, v in FROZEN_FLAGS.items()}


def test_every_key_is_documented_with_its_default_and_variable() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z_.]+)` \|.*$", doc, re.M)}
    for key in (k for s in settings.SECTIONS for k in settings.keys(s)):
        assert key.path in rows, f"{key.path} is not in docs/configuration.md"
        row = rows[key.path]
        assert f"`{key.env}`" in row, (key.path, key.env)
        if key.path != "agent.node":  # the host name
            shown = {None: "none", "": '`""`'}.get(key.default, f"`{key.default}`")
            assert f"| {shown} |" in row, (key.path, shown, row)
    assert set(rows) == set(FROZEN_KEYS)


def test_environment_names_are_distinct() -> None:
    names = [k.env for s in settings.SECTIONS for k in settings.keys(s)]
    assert len(names) == len(set(names))


def other_value(key: settings.Key) -> Any:
    """A valid value other than the key's default (what the test sets it to)."""
    special = {
        "controller.port": 9000,
        "controller.stragglers.min_samples": 20,
        "controller.stragglers.persistence_ratio": 0.5,
        "controller.spare_risk": 0.05,
        "controller.pipeline.margin_ratio": 0.2,
        "controller.cadence.max_interval_s": 7200.0,
        "agent.gpu_source": "nvml",
        "controller.backend": "kubernetes",
        "agent.metrics_port": 9000,
        "agent.datagram_port": 9465,
        "controller.liveness_port": 9471,
        "controller.heartbeat_port": 9472,
        "controller.telemetry.hysteresis_ratio": 0.2,
        "agent.receive_buffer_bytes": 1 << 23,
        "agent.controller_url": "http://controller:8470/v1/heartbeat",
        "controller.kubernetes.node_selector": "pool=a; cloud.google.com/gke-accelerator",
        "controller.kubernetes.watch_namespace": "training,research",
    }
    if key.path in special:
        return special[key.path]
    kind = key.type if not settings._optional(key.type) else str
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return next(m for m in kind if m != key.default).value
    if kind is bool:
        return not key.default
    if kind is int:
        return int(key.default) * 2 + 1
    if kind is float:
        return float(key.default) * 2 + 1
    return f"/tmp/x-{key.path}"


@pytest.mark.parametrize("section", list(settings.SECTIONS))
def test_every_key_is_settable_from_a_file(tmp_path: Path, section: str) -> None:
    """Each key, set in a file, reaches the component's configuration (every ControllerConfig knob included)."""
    doc: dict[str, Any] = {}
    wanted = {}
    for key in settings.keys(section):
        value = other_value(key)
        wanted[key.path] = value
        table = doc
        *parents, leaf = key.path.split(".")
        for part in parents:
            table = table.setdefault(part, {})
        table[leaf] = value
    path = tmp_path / "opsd.json"  # YAML reads JSON
    path.write_text(json.dumps(doc))
    built = settings.load(section, str(path), env={})
    for key_path, value in wanted.items():
        assert get(built, key_path.split(".")[1:]) == value, key_path


def get(config: Any, path: list[str]) -> Any:
    """A key's value in a built configuration, inline sections looked into (``ControllerSettings.serve``,
    ``ServeConfig.controller``), a backend's section by its name (``ControllerSettings.section``)."""
    for part in path:
        if isinstance(config, settings.ControllerSettings) and part in config.sections:
            config = config.section(part)
            continue
        while not hasattr(config, part):
            inline = next(f.name for f in dataclasses.fields(config) if f.metadata.get("inline"))
            config = getattr(config, inline)
        config = getattr(config, part)
    return config


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "opsd.toml"
    path.write_text('[controller]\nport = 9001\nhost = "0.0.0.0"\n[controller.detection]\nhang_floor_s = 30\n')
    from_file = settings.load("controller", str(path), env={}).serve
    assert isinstance(from_file, ServeConfig)
    assert (from_file.port, from_file.host, from_file.controller.detection.hang_floor_s) == (9001, "0.0.0.0", 30.0)
    env = {"OPSD_CONTROLLER_PORT": "9002", "OPSD_CONTROLLER_DETECTION_HANG_FLOOR_S": "45", "OPSD_STATE_DIR": "/s"}
    from_env = settings.load("controller", str(path), env=env).serve
    assert (from_env.port, from_env.controller.detection.hang_floor_s, from_env.state_dir) == (9002, 45.0, "/s")
    flagged = settings.load("controller", str(path), env=env, flags={"port": 9003, "host": None}).serve
    assert (flagged.port, flagged.host) == (9003, "0.0.0.0")  # None: the flag was not given


def test_a_command_s_own_defaults_sit_below_the_file(tmp_path: Path) -> None:
    defaults = {"detection.hang_floor_s": 6.0, "detection.heartbeat_floor_s": 3.0}
    assert settings.load("controller", None, env={}, defaults=defaults).serve.controller.detection.hang_floor_s == 6.0
    path = tmp_path / "opsd.yaml"
    path.write_text("controller:\n  detection:\n    hang_floor_s: 20\n")
    detection = settings.load("controller", str(path), env={}, defaults=defaults).serve.controller.detection
    assert (detection.hang_floor_s, detection.heartbeat_floor_s) == (20.0, 3.0)


def test_the_agent_s_variables_keep_their_names() -> None:
    env = {"OPSD_AGENT_SOCKET": "/run/a.sock", "OPSD_POLICY_FILE": "/run/p.json", "OPSD_CONTROLLER_TOKEN": "t"}
    config = settings.load("agent", None, env={**env, "OPSD_AGENT_XID_TABLE": ""})
    assert isinstance(config, AgentConfig)
    assert (config.socket, config.policy_file, config.controller_token, config.xid_table) == (
        "/run/a.sock",
        "/run/p.json",
        "t",
        None,
    )


BAD = {
    # name: (file text, file suffix, environment, message)
    "unknown key": ("[controller]\nprot = 1\n", ".toml", {}, r"unknown key controller\.prot"),
    "unknown nested key": (
        "controller:\n  detection:\n    hang_flor_s: 1\n",
        ".yaml",
        {},
        r"controller\.detection\.hang",
    ),
    "unknown section": ("[controler]\nport = 1\n", ".toml", {}, r"unknown sections \['controler'\]"),
    "wrong type": ('[controller]\nport = "8470"\n', ".toml", {}, r"controller\.port must be an integer"),
    "a bool is no number": ("controller:\n  tick_interval_s: true\n", ".yaml", {}, r"must be a number"),
    "refused by its dataclass": (
        "[controller.detection]\nhang_floor_s = -1\n",
        ".toml",
        {},
        r"hang_floor_s must be > 0",
    ),
    "a section that is no table": ("controller: 3\n", ".yaml", {}, r"controller must be a table"),
    "not TOML": ("[controller\n", ".toml", {}, r"settings file .*opsd\.toml"),
    "a bad variable": ("", ".yaml", {"OPSD_CONTROLLER_PORT": "eighty"}, r"\$OPSD_CONTROLLER_PORT: controller\.port"),
}


@pytest.mark.parametrize(("text", "suffix", "env", "message"), BAD.values(), ids=BAD.keys())
def test_bad_settings_are_refused_with_the_key(
    tmp_path: Path, text: str, suffix: str, env: dict[str, str], message: str
) -> None:
    path = tmp_path / f"opsd{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        settings.load("controller", str(path), env=env)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        settings.load("agent", str(tmp_path / "none.yaml"), env={})


def test_the_agent_runs_on_a_settings_file_and_its_flags_win(tmp_path: Path) -> None:
    """`opsd agent --config`: the file sets the socket and the port; a flag overrides the file's node name."""
    sock, port = tmp_path / "agent.sock", free_port()
    config = tmp_path / "opsd.yaml"
    config.write_text(f"agent:\n  socket: {sock}\n  metrics_port: {port}\n  node: from-file\n")
    args = ["--config", str(config), "--node", "from-flag"]
    health, ended = agent_until_sigterm(args, port, lambda: None if sock.exists() else pytest.fail("no socket"))
    assert health["node"] == "from-flag"
    assert ended.returncode == 0, ended.stderr
    assert f"datagrams on {sock}" in ended.stdout


def test_serve_refuses_a_bad_settings_file_with_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "opsd.toml"
    config.write_text("[controller]\nport = 99999\n")
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["serve", "--config", str(config)])
    assert result.exit_code == 2
    assert "controller.port must be in 0..65535" in " ".join(result.output.replace("│", " ").split())
