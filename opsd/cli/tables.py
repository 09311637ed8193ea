"""The operator commands' tables (rich) of what the controller answers, and the formats of their cells."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from rich.table import Table


def when(unix_s: float | None) -> str:
    if unix_s is None:
        return "-"
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%d %H:%M:%S")


def size(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(nbytes)


def seconds(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# -- tables ----------------------------------------------------------------------------------------------------
def runs_table(body: list[dict[str, Any]]) -> Table:
    table = Table(title="runs")
    for column in ("run", "state", "launch", "step", "started (UTC)", "updated (UTC)"):
        table.add_column(column, no_wrap=True)
    for r in body:
        table.add_row(
            r["id"], r["state"], str(r["generation"]), str(r["last_step"]), when(r["created_s"]), when(r["updated_s"])
        )
    return table


def status_table(body: dict[str, Any]) -> Table:
    table = Table(title=f"run {body['run']}", show_header=False)
    cadence = body["cadence"]
    rows = [
        ("state", f"{body['state']} (launch {body['generation']})"),
        ("step", str(body["step"])),
        ("ranks", str(body["ranks"])),
        ("MFU", f"{body['mfu_ratio']:.3f}"),
        ("tokens/s", f"{body['tokens_per_s']:.0f}"),
        ("ETTR", f"{body['ettr']:.3f}"),
        ("checkpoint cadence", f"every {cadence['every_steps']} steps from {cadence['from_step']}" if cadence else "-"),
        ("nodes", ", ".join(f"{n['name']} ({n['role']})" for n in body["nodes"]) or "-"),
        ("spares available", str(body["spares_available"])),
        ("stragglers", ", ".join(f"rank {s['rank']} {s['slowdown_ratio']:.2f}x" for s in body["stragglers"]) or "none"),
        ("open incidents", str(body["open_incidents"])),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def statuses_table(body: list[dict[str, Any]]) -> Table:
    table = Table(title="runs")
    for column in ("run", "state", "step", "ranks", "MFU", "tokens/s", "ETTR", "spares", "stragglers", "open"):
        table.add_column(column, no_wrap=True)
    for s in body:
        table.add_row(
            s["run"],
            s["state"],
            str(s["step"]),
            str(s["ranks"]),
            f"{s['mfu_ratio']:.3f}",
            f"{s['tokens_per_s']:.0f}",
            f"{s['ettr']:.3f}",
            str(s["spares_available"]),
            str(len(s["stragglers"])),
            str(s["open_incidents"]),
        )
    return table


def incidents_table(body: list[dict[str, Any]]) -> Table:
    table = Table(title="incidents")
    columns = ("id", "run", "kind", "node", "rank", "state", "detected after s", "recovered after s", "lost steps")
    for column in columns:
        table.add_column(column, no_wrap=True)
    table.add_column("detail", overflow="fold")
    for i in body:
        table.add_row(
            str(i["id"]),
            i["run"],
            i["kind"],
            i["node"] or "-",
            "-" if i["rank"] is None else str(i["rank"]),
            i["state"],
            f"{i['detected_s'] - i['failed_s']:.1f}",
            f"{i['resumed_s'] - i['detected_s']:.1f}" if i["resumed_s"] else "-",
            "-" if i["lost_steps"] is None else str(i["lost_steps"]),
            i["detail"],
        )
    return table


def spares_table(body: dict[str, Any]) -> Table:
    table = Table(title="spare pools")
    for column in ("run", "active nodes", "spares (health)", "usable", "recommended", "cordoned"):
        table.add_column(column, no_wrap=True)
    table.add_column("why", overflow="fold")
    for r in body["runs"]:
        table.add_row(
            r["run"],
            str(r["active_nodes"]),
            ", ".join(f"{s['name']} ({s['health']})" for s in r["spares"]) or "none",
            str(r["available"]),
            str(r["recommended"]),
            ", ".join(c["name"] for c in r["cordoned"]) or "-",
            r["why"],
        )
    shared = body.get("shared")
    if shared is not None:
        table.add_row(
            "(shared pool)",
            str(shared["active_nodes"]),
            ", ".join(f"{s['name']} ({s['health']})" for s in shared["spares"]) or "none",
            str(shared["available"]),
            str(shared["recommended"]),
            "-",
            shared["why"],
        )
    return table


def checkpoints_table(body: dict[str, Any]) -> Table:
    table = Table(title=f"checkpoints of {body['run']} ({body['url'] or 'no store'})")
    for column in ("step", "state", "size", "committed (UTC)", "blocking s", "save s"):
        table.add_column(column, no_wrap=True)
    table.add_column("problem", overflow="fold")
    for c in body["checkpoints"]:
        table.add_row(
            str(c["step"]),
            c["state"],
            size(c["bytes"]),
            when(c["time_unix_s"]),
            seconds(c["blocking_s"], 3),
            seconds(c["save_s"], 2),
            c["problem"] or "",
        )
    return table


def cadence_table(body: dict[str, Any]) -> Table:
    table = Table(title=f"checkpoint cadence of {body['run']}", show_header=False)
    cadence = body["cadence"]
    rows = [
        ("cadence", f"every {cadence['every_steps']} steps from step {cadence['from_step']}" if cadence else "-"),
        ("every (s)", seconds(cadence["every_s"]) if cadence else "-"),
        ("run MTBF (s)", seconds(body["mtbf_s"], 0)),
        ("node MTBF (h)", f"{body['node_mtbf_h']:,.0f}"),
        ("failures / node-hours", f"{body['failures']} / {body['node_hours']:,.2f}"),
        ("checkpoint cost (s)", seconds(body["checkpoint_cost_s"], 3)),
        ("step time (s)", seconds(body["step_s"], 3)),
        ("Young / Daly interval (s)", f"{seconds(body['young_interval_s'])} / {seconds(body['daly_interval_s'])}"),
        ("why", body["why"]),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table
