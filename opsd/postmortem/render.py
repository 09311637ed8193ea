"""Markdown and HTML renderings of a post-mortem ``Report`` (``opsd.postmortem.model``): one list of sections, two
renderings, so both say the same. Every string taken from the bundle is escaped: Markdown's and HTML's special
characters in Markdown, ``html.escape`` in HTML, whose page also carries a Content-Security-Policy that forbids
scripts and any fetch."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Callable
from dataclasses import dataclass

from opsd.postmortem.model import (
    XID_ACTION_WORDS,
    IncidentReport,
    PipelineBubble,
    Report,
    clock,
    describe,
    seconds,
)
from opsd.protocol.answers import Mtbf
from opsd.protocol.flight_analysis import FlightAnalysis


def _offset(value: float | None) -> str:
    return "?" if value is None else f"+{value:.1f} s" if value >= 0 else f"{value:.1f} s"


def _opt(value: object) -> str:
    return "?" if value is None else str(value)


# -- sections (one structure, two renderings) ------------------------------------------------------------------
@dataclass(frozen=True)
class _Facts:
    items: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class _Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class _Text:
    text: str


@dataclass(frozen=True)
class _Code:
    title: str
    text: str


@dataclass(frozen=True)
class _Plot:
    name: str  # timeline | badput | stragglers | checkpoints
    alt: str


_Block = _Facts | _Table | _Text | _Code | _Plot


@dataclass(frozen=True)
class _Section:
    level: int
    title: str
    blocks: tuple[_Block, ...]


def _sections(report: Report) -> list[_Section]:
    g = report.goodput
    scope = f"incident {report.incident_id}" if report.incident_id is not None else "the whole run"
    out = [
        _Section(
            1,
            f"Post-mortem of run {report.run_id}"
            + (f", incident {report.incident_id}" if report.incident_id is not None else ""),
            (
                _Facts(
                    (
                        ("scope", scope),
                        ("generated", clock(report.generated_unix_s)),
                        ("run state", _opt(report.run_state)),
                        ("started", clock(report.created_unix_s)),
                        ("launches", _opt(report.generation)),
                        ("last step", _opt(report.last_step)),
                        ("final step", _opt(report.final_step)),
                        ("ETTR", "?" if g.ettr is None else f"{g.ettr:.3f}"),
                        ("MTBF", _mtbf(g.mtbf)),
                        ("cordoned nodes", "; ".join(f"{n}: {why}" for n, why in report.cordoned) or "none"),
                    )
                ),
            ),
        )
    ]
    if report.totals is not None:
        t = report.totals
        rows: tuple[tuple[str, ...], ...] = tuple(
            (
                str(i.id),
                i.kind,
                i.node,
                _rank(i.rank),
                i.state,
                clock(i.failed_unix_s),
                seconds(i.detection_delay_s) if i.is_failure else "",
                seconds(i.downtime_s) if i.is_failure else "",
                _opt(i.lost_steps) if i.is_failure else "",
                _opt(i.resume.step) if i.is_failure else "",
                i.detail,
            )
            for i in report.incidents
        )
        headers = ("id", "kind", "node", "rank", "state", "failed", "detection", "down", "lost steps", "resumed from")
        totals = (
            ("interruptions", str(t.interruptions)),
            ("by kind", ", ".join(f"{k} {n}" for k, n in t.by_kind) or "none"),
            ("straggler warnings", str(t.straggler_warnings)),
            ("downtime", seconds(t.downtime_s)),
            ("detection", seconds(t.detection_s)),
            ("lost steps", str(t.lost_steps)),
            ("recomputed", seconds(t.recompute_s)),
        )
        listed: _Block = _Table((*headers, "detail"), rows) if rows else _Text("No incidents.")
        blocks: list[_Block] = [listed, _Facts(totals)]
        if report.detailed:
            blocks.insert(0, _Plot("timeline", "recovery phases of every incident, in seconds after its failure"))
        out.append(_Section(2, "Incidents", tuple(blocks)))
    for i in report.detailed:
        out += _incident_sections(i, with_plot=report.incident_id is not None)
    badput = tuple((bucket, seconds(v)) for bucket, v in g.badput_s)
    out.append(
        _Section(
            2,
            "Goodput",
            (
                _Facts(
                    (
                        ("ETTR", "?" if g.ettr is None else f"{g.ettr:.3f} (productive time / wall time)"),
                        ("MFU", _measured(g.mfu_ratio, g.mfu_last, g.mfu_average, g.last_launch, ".3f")),
                        (
                            "tokens/s",
                            _measured(
                                g.tokens_per_s, g.tokens_per_s_last, g.tokens_per_s_average, g.last_launch, ",.0f"
                            ),
                        ),
                        *((("pipeline bubble", _bubble(g.pipeline)),) if g.pipeline is not None else ()),
                    )
                ),
                _Table(("badput bucket", "time"), badput),
                _Plot("badput", "badput by bucket"),
            ),
        )
    )
    if report.stragglers:
        rows = tuple(
            (str(s.incident_id), clock(s.time_unix_s), _opt(s.rank), s.node, _ratio(s.slowdown_ratio), s.detail)
            for s in report.stragglers
        )
        stragglers: tuple[_Block, ...] = (
            _Table(("incident", "time", "rank", "node", "slowdown", "detail"), rows),
            _Plot("stragglers", "straggler slowdown per rank over time"),
        )
    else:
        stragglers = (_Text("No straggler warnings."),)
    out.append(_Section(2, "Straggler history", stragglers))
    rows = tuple(
        (
            str(c.step),
            c.state,
            c.problem or "",
            "?" if c.bytes is None else f"{c.bytes:,}",
            clock(c.time_unix_s),
        )
        for c in report.checkpoints
    )
    blocking = (
        ("saves", _opt(g.checkpoint_saves)),
        ("blocking, mean", seconds(g.checkpoint_blocking_mean_s)),
        ("blocking, max", seconds(g.checkpoint_blocking_max_s)),
    )
    ckpt: tuple[_Block, ...] = (
        (_Table(("step", "state", "problem", "bytes", "committed"), rows), _Facts(blocking))
        if rows
        else (_Text("No checkpoints."), _Facts(blocking))
    )
    if rows:
        ckpt += (_Plot("checkpoints", "checkpoint steps over time, torn ones marked"),)
    out.append(_Section(2, "Checkpoints", ckpt))
    for d in report.dumps:
        out.append(_Section(2, f"Flight Recorder dump {d.trigger}", _fr_blocks(d)))
    return out


def _mtbf(m: Mtbf) -> str:
    """The MTBF estimate and its inputs, in words."""
    if m.mtbf_s is None:
        return "? (no node of the run known)"
    inputs = []
    if m.failures is not None and m.node_hours is not None:
        inputs.append(f"{m.failures} failure{'' if m.failures == 1 else 's'} in {m.node_hours:,.1f} node-hours")
    if m.nodes is not None:
        inputs.append(f"{m.nodes} nodes")
    if m.node_mtbf_h is not None:
        inputs.append(f"a node MTBF of {m.node_mtbf_h:,.0f} h")
    prior = m.prior
    if prior.node_mtbf_h is not None and prior.node_hours is not None:
        inputs.append(f"prior: {prior.node_mtbf_h:,.0f} h per node, worth {prior.node_hours:,.0f} node-hours")
    return seconds(m.mtbf_s) + (f" ({'; '.join(inputs)})" if inputs else "")


def _measured(live: float | None, last: float | None, average: float | None, launch: int | None, fmt: str) -> str:
    """A job figure: live while the ranks report, else the last recorded sample; the run's average beside it."""
    if live:
        text = format(live, fmt)
    elif last is not None:
        text = format(last, fmt) + (f" (last measured, launch {launch})" if launch is not None else " (last measured)")
    else:
        text = "?"
    return text + (f"; run average {format(average, fmt)}" if average is not None else "")


def _bubble(p: PipelineBubble) -> str:
    """``0.41 (last measured, launch 2), theory 0.27 for 1f1b, 4 stages x 8 micro-batches; run average 0.39``."""
    text = f"{p.bubble_ratio:.2f}" + ("" if p.launch is None else f" (last measured, launch {p.launch})")
    if p.theoretical_ratio is not None:
        text += (
            f", theory {p.theoretical_ratio:.2f} for {p.schedule}, {p.stages} stages x {p.micro_batches} micro-batches"
        )
    return text + (f"; run average {p.average_ratio:.2f}" if p.average_ratio is not None else "")


def _rank(rank: int | None) -> str:
    return "-" if rank is None else str(rank)


def _ratio(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}x"


def _fr_blocks(d: FlightAnalysis) -> tuple[_Block, ...]:
    blocks: list[_Block] = [
        _Facts(
            (
                ("summary", d.summary or "none"),
                ("ranks dumped", f"{len(d.ranks_dumped)} of {len(d.ranks_expected)}"),
                (
                    "ranks missing",
                    ", ".join(str(r) for r in sorted(set(d.ranks_expected) - set(d.ranks_dumped))) or "none",
                ),
            )
        )
    ]
    if d.culprits:
        rows: tuple[tuple[str, ...], ...] = tuple(
            (_opt(c.rank), c.reason, describe(c.last_collective) if c.last_collective else "?") for c in d.culprits
        )
        blocks.append(_Table(("culprit rank", "why", "last collective"), rows))
    if d.groups:
        rows = tuple(
            (
                g.group + (f" (pg {g.pg_id})" if g.pg_id is not None else ""),
                _opt(g.op),
                _opt(g.stuck_seq),
                ", ".join(map(str, g.joined)),
                ", ".join(map(str, g.missing)),
            )
            for g in d.groups
        )
        blocks.append(_Table(("group", "op", "stuck at", "joined", "missing"), rows))
    blocks += [_Code(f"stack of rank {c.rank}", c.stack) for c in d.culprits if c.stack]
    return tuple(blocks)


def _incident_sections(i: IncidentReport, *, with_plot: bool) -> list[_Section]:
    c = i.root_cause
    facts = [("kind", f"{i.kind}: {c.words}"), ("node", i.node), ("rank", _rank(i.rank)), ("detail", i.detail)]
    if c.xid is not None:
        x = c.xid
        facts += [("XID", str(x.code)), ("GPU", str(x.gpu)), ("meaning", x.meaning)]
        facts.append(("action", f"{x.action} ({XID_ACTION_WORDS.get(x.action, x.action)})" if x.action else "?"))
    if c.exit is not None:
        facts += [("exit code", _opt(c.exit.exit_code)), ("signal", c.exit.signal_name or "none")]
    cause: list[_Block] = [_Text(c.summary), _Facts(tuple(facts))]
    if c.flight_recorder is not None:
        cause += _fr_blocks(c.flight_recorder)
    out = [
        _Section(
            2,
            f"Incident {i.id}: {c.words} on {i.node}",
            (_Text(f"{'Failed' if i.is_failure else 'Warned'} at {clock(i.failed_unix_s)}; {i.state}."),)
            + ((_Facts((("trace id", i.trace_id),)),) if i.trace_id else ()),
        ),
        _Section(3, "Root cause", tuple(cause)),
    ]
    if not i.is_failure:
        return out
    rows: tuple[tuple[str, ...], ...] = tuple(
        (p.name, _offset(p.start_s), _offset(p.end_s), "" if p.name == "failure" else seconds(p.duration_s), p.detail)
        for p in i.timeline
    )
    timeline: list[_Block] = [_Table(("phase", "from", "to", "took", "what"), rows)]
    if i.collectives:
        stacks = tuple((stack.replace(";", " / "), seconds(s)) for stack, s in i.collectives)
        timeline.append(_Text(f"Where launch {i.launch}'s collective time went (every rank, longest first):"))
        timeline.append(_Table(("phase / dimension / op", "time"), stacks))
    if with_plot:
        timeline.append(_Plot("timeline", "recovery phases in seconds after the failure"))
    lost: tuple[tuple[str, str], ...] = (
        ("detection delay", seconds(i.detection_delay_s)),
        ("down (failure to first productive step)", seconds(i.downtime_s) + (" so far" if i.state == "open" else "")),
        ("lost steps", _opt(i.lost_steps)),
        ("recomputed", seconds(i.recompute_s)),
        ("spare", i.spare or "none"),
    )
    if i.replica_group is not None:
        lost += (
            ("replica recovery", f"replica group {i.replica_group} alone: the other groups trained on"),
            ("steps the group missed", _opt(i.missed_steps)),
            ("the other groups' wait for a quorum", seconds(i.stall_s)),
        )
    resume: list[_Block] = [_Text(i.resume.reason)]
    if i.resume.skipped:
        rows = tuple((str(s.step), s.state, s.problem) for s in i.resume.skipped)
        resume.append(_Table(("skipped step", "state", "problem"), rows))
    out += [
        _Section(3, "Timeline", tuple(timeline)),
        _Section(3, "Detection and lost work", (_Facts(lost),)),
        _Section(3, "Resumed from", tuple(resume)),
    ]
    return out


# -- Markdown ---------------------------------------------------------------------------------------------------
_MD_SPECIAL = re.compile(r"([\\`*\[\]<>|])")


def _md(text: str) -> str:
    """Text safe in a Markdown paragraph or table cell: one line, the characters Markdown or HTML act on escaped."""
    return _MD_SPECIAL.sub(r"\\\1", " ".join(text.split()))


def to_markdown(report: Report) -> str:
    """The report as GitHub-flavoured Markdown (the plots are in the HTML only)."""
    lines: list[str] = []
    for s in _sections(report):
        lines += ["#" * s.level + " " + _md(s.title), ""]
        for b in s.blocks:
            if isinstance(b, _Text):
                lines += [_md(b.text), ""]
            elif isinstance(b, _Facts):
                lines += [f"- **{_md(k)}**: {_md(v)}" for k, v in b.items] + [""]
            elif isinstance(b, _Table):
                lines.append("| " + " | ".join(_md(h) for h in b.headers) + " |")
                lines.append("|" + "---|" * len(b.headers))
                lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in b.rows]
                lines.append("")
            elif isinstance(b, _Code):
                fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", b.text)), default=0))
                lines += [f"{_md(b.title)}:", "", fence + "text", b.text.rstrip("\n"), fence, ""]
    return "\n".join(lines).rstrip("\n") + "\n"


# -- HTML -------------------------------------------------------------------------------------------------------
_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d2430; margin: 0;
       background: #f4f5f7; }
main { max-width: 1120px; margin: 0 auto; padding: 24px 32px 48px; background: #fff; }
h1 { font-size: 26px; margin: 0 0 12px; border-bottom: 3px solid #c0392b; padding-bottom: 8px; }
h2 { font-size: 20px; margin: 28px 0 8px; border-bottom: 1px solid #d5d9e0; padding-bottom: 4px; }
h3 { font-size: 16px; margin: 18px 0 6px; color: #34495e; }
table { border-collapse: collapse; margin: 8px 0 12px; font-size: 13px; }
th, td { border: 1px solid #d5d9e0; padding: 4px 8px; text-align: left; vertical-align: top; }
td:not(:last-child) { white-space: nowrap; }
th { background: #eef1f5; }
tr:nth-child(even) td { background: #fafbfc; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 8px 0 12px; }
dl.facts dt { font-weight: 600; color: #4a5568; }
dl.facts dd { margin: 0; }
pre { background: #1e2430; color: #e8ecf1; padding: 10px 12px; overflow-x: auto; font-size: 12px; border-radius: 4px; }
img.plot { display: block; max-width: 100%; margin: 8px 0 16px; border: 1px solid #e2e5ea; }
p.lead { font-size: 16px; }
"""


def _h(text: str) -> str:
    return html.escape(text, quote=True)


def to_html(report: Report) -> str:
    """The report as one self-contained HTML page: inline CSS, the plots as PNG data URLs, no script, nothing
    fetched (a Content-Security-Policy says so to the browser too)."""
    from opsd.postmortem import plots

    cache: dict[str, bytes | None] = {}
    draw: dict[str, Callable[[], bytes | None]] = {
        "timeline": lambda: plots.timeline_png(report.detailed),
        "badput": lambda: plots.badput_png(report.goodput),
        "stragglers": lambda: plots.stragglers_png(
            report.stragglers, report.created_unix_s, report.updated_unix_s or report.generated_unix_s
        ),
        "checkpoints": lambda: plots.checkpoints_png(report),
    }
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
        "style-src 'unsafe-inline'\">",
        f"<title>{_h(f'Post-mortem of run {report.run_id}')}</title>",
        f"<style>{_CSS}</style></head><body><main>",
    ]
    for s in _sections(report):
        parts.append(f"<h{s.level}>{_h(s.title)}</h{s.level}>")
        for b in s.blocks:
            if isinstance(b, _Text):
                parts.append(f'<p class="lead">{_h(b.text)}</p>')
            elif isinstance(b, _Facts):
                items = "".join(f"<dt>{_h(k)}</dt><dd>{_h(v)}</dd>" for k, v in b.items)
                parts.append(f'<dl class="facts">{items}</dl>')
            elif isinstance(b, _Table):
                head = "".join(f"<th>{_h(h)}</th>" for h in b.headers)
                body = "".join("<tr>" + "".join(f"<td>{_h(c)}</td>" for c in row) + "</tr>" for row in b.rows)
                parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
            elif isinstance(b, _Code):
                parts.append(f"<p>{_h(b.title)}:</p><pre>{_h(b.text)}</pre>")
            elif isinstance(b, _Plot):
                if b.name not in cache:
                    cache[b.name] = draw[b.name]()
                png = cache[b.name]
                if png is not None:
                    data = base64.b64encode(png).decode("ascii")
                    parts.append(f'<img class="plot" alt="{_h(b.alt)}" src="data:image/png;base64,{data}">')
    parts.append("</main></body></html>")
    return "\n".join(parts) + "\n"
