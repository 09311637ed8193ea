"""Flame graphs of a run's time in collectives: folded stacks, and an SVG drawn here (docs/flamegraph.md).

A run's collective time is a tree, ``step`` -> phase -> mesh dimension -> op, weighted by microseconds of
collective time summed over the run's ranks and steps. It is written as folded stacks, Brendan Gregg's format
that flamegraph.pl, inferno and speedscope read: one line per stack, frames joined by ``;``, a space, and an
integer weight::

    step;backward;dp_shard;reduce_scatter 1830211
    step;forward;dp_shard;all_gather 2210034
    step;forward;tp;all_reduce 640002

Pure: no I/O, no clocks. Malformed input raises ``PermanentError`` naming what is wrong.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from xml.sax.saxutils import escape

from opsd.errors import PermanentError

ROOT = "step"
MICROSECONDS_PER_S = 1_000_000
Stack = tuple[str, ...]

# the colour of each mesh dimension's frames (and of its ops' frames); other names get one from their hash
DIMENSION_COLOURS = {
    "dp_replicate": "#e15759",
    "dp_shard": "#f28e2b",
    "tp": "#4e79a7",
    "pp": "#59a14f",
    "cp": "#b07aa1",
    "ep": "#edc948",
    "other": "#bab0ac",
}
NEUTRAL_COLOUR = "#d4d4d4"  # the root, the step and the phases
_DIMENSION_INDEX = 2  # in a stack: step, phase, dimension, op

_WEIGHT = re.compile(r"\d+(?:\.\d*)?")  # as flamegraph.pl reads it
_FRAME_UNSAFE = re.compile(r"[;\r\n]")
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")

FRAME_HEIGHT_PX = 17
FONT_SIZE_PX = 12
CHAR_WIDTH_RATIO = 0.59  # of the font size: the average width of a character
MARGIN_PX = 10
TITLE_HEIGHT_PX = 34


def fold(entries: Iterable[Sequence[Any]]) -> dict[Stack, float]:
    """Stacks ``("step", phase, dimension, op)`` weighted by microseconds, from entries whose first four items are
    phase, dimension, op and seconds (a heartbeat's ``comms`` rows without their run, or the items of
    ``Controller.comm_seconds``); entries of one stack add up, stacks of no time are left out."""
    stacks: dict[Stack, float] = {}
    for entry in entries:
        if len(entry) < 4:
            raise PermanentError(f"flame graph entry {list(entry)!r}: expected phase, dimension, op, seconds")
        phase, dimension, op, seconds = entry[0], entry[1], entry[2], entry[3]
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds):
            raise PermanentError(f"flame graph entry {list(entry)!r}: seconds must be a finite number")
        if seconds < 0:
            raise PermanentError(f"flame graph entry {list(entry)!r}: seconds must be >= 0")
        if seconds == 0:
            continue
        stack = (ROOT, str(phase), str(dimension), str(op))
        stacks[stack] = stacks.get(stack, 0.0) + seconds * MICROSECONDS_PER_S
    return stacks


def _frame(name: str) -> str:
    """A frame name fit for a folded line: ``;`` and line breaks become ``_``; an empty name is ``_``."""
    return _FRAME_UNSAFE.sub("_", name) or "_"


def to_folded(stacks: Mapping[Stack, float]) -> str:
    """The folded text of ``stacks``: one line per stack, sorted, weights rounded to integers (stacks that round
    to 0 are left out); frame names have ``;`` and line breaks replaced by ``_``. Empty when there is nothing."""
    lines = []
    for stack, weight in sorted(stacks.items()):
        if not math.isfinite(weight) or weight < 0:
            raise PermanentError(f"stack {';'.join(stack)!r}: weight must be a finite number >= 0, got {weight!r}")
        rounded = round(weight)
        if rounded > 0 and stack:
            lines.append(f"{';'.join(_frame(f) for f in stack)} {rounded}\n")
    return "".join(lines)


def parse_folded(text: str) -> dict[Stack, float]:
    """Stacks and weights of folded text (blank lines skipped, repeated stacks added up). Raises
    ``PermanentError`` naming the first malformed line: no weight, a weight that is not a number >= 0, an empty
    frame."""
    stacks: dict[Stack, float] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        shown = line if len(line) <= 200 else line[:200] + "..."
        frames_text, space, weight_text = line.rpartition(" ")
        if not space or not frames_text:
            raise PermanentError(f"folded line {number}: expected 'frame;frame;... weight', got {shown!r}")
        if not _WEIGHT.fullmatch(weight_text):
            raise PermanentError(f"folded line {number}: weight {weight_text!r} is not a number >= 0 in {shown!r}")
        frames = tuple(frames_text.split(";"))
        if any(not f for f in frames):
            raise PermanentError(f"folded line {number}: empty frame in {shown!r}")
        stacks[frames] = stacks.get(frames, 0.0) + float(weight_text)
    return stacks


def _duration(microseconds: float) -> str:
    seconds = microseconds / MICROSECONDS_PER_S
    if seconds >= 1:
        return f"{seconds:,.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{microseconds:.0f} us"


def _colour(path: Stack) -> str:
    if len(path) <= _DIMENSION_INDEX:
        return NEUTRAL_COLOUR
    dimension = path[_DIMENSION_INDEX]
    known = DIMENSION_COLOURS.get(dimension)
    if known is not None:
        return known
    hue = zlib.crc32(dimension.encode()) % 360
    return f"hsl({hue},60%,65%)"


def _text(value: str) -> str:
    """``value`` as XML character data: escaped, characters XML 1.0 forbids replaced by ``?``."""
    return escape(_NOT_XML.sub("?", value))


def _label(name: str, width_px: float) -> str:
    """``name`` cut to fit ``width_px`` (ending in ``..``), or empty when not even 3 characters fit."""
    fit = int((width_px - 6) / (FONT_SIZE_PX * CHAR_WIDTH_RATIO))
    if fit < 3:
        return ""
    return name if len(name) <= fit else name[: fit - 2] + ".."


def render_svg(stacks: Mapping[Stack, float], title: str, width_px: int = 1200) -> str:
    """A self-contained SVG flame graph of ``stacks``: one ``<rect>`` per frame (the root ``all`` at the bottom,
    each frame above its caller), its width proportional to its weight, its name cut to fit, a ``<title>``
    tooltip with the frame, its time (weights are microseconds) and its share of the total; frames coloured by
    mesh dimension. Names and title are escaped: the document is valid XML."""
    if width_px < 2 * MARGIN_PX + 10:
        raise PermanentError(f"flame graph width must be >= {2 * MARGIN_PX + 10} px, got {width_px}")
    weights: dict[Stack, float] = {}  # every frame (a prefix of a stack) -> its weight
    for stack, weight in stacks.items():
        if not math.isfinite(weight) or weight < 0:
            raise PermanentError(f"stack {';'.join(stack)!r}: weight must be a finite number >= 0, got {weight!r}")
        if weight == 0:
            continue
        for depth in range(len(stack) + 1):
            prefix = stack[:depth]
            weights[prefix] = weights.get(prefix, 0.0) + weight
    total = weights.get((), 0.0)
    depth_max = max((len(p) for p in weights), default=0)
    height_px = TITLE_HEIGHT_PX + (depth_max + 1) * FRAME_HEIGHT_PX + MARGIN_PX
    scale = (width_px - 2 * MARGIN_PX) / total if total > 0 else 0.0
    out = [
        '<?xml version="1.0" encoding="UTF-8" standalone="no"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="{width_px}" height="{height_px}" '
        f'viewBox="0 0 {width_px} {height_px}" font-family="Verdana, sans-serif" font-size="{FONT_SIZE_PX}" '
        'style="background-color: #ffffff">',
        f'<text x="{width_px / 2:.1f}" y="22" text-anchor="middle" font-size="16">{_text(title)}</text>',
    ]
    if total <= 0:
        out.append(f'<text x="{width_px / 2:.1f}" y="{TITLE_HEIGHT_PX + 12}" text-anchor="middle">no data</text>')
    # frames in order: each one's children left to right by name, from the left of their caller
    lefts: dict[Stack, float] = {(): MARGIN_PX}
    children: dict[Stack, list[Stack]] = {}
    for path in weights:
        if path:
            children.setdefault(path[:-1], []).append(path)
    pending: list[Stack] = [()] if total > 0 else []
    while pending:
        path = pending.pop()
        x = lefts[path]
        width = weights[path] * scale
        y = height_px - MARGIN_PX - (len(path) + 1) * FRAME_HEIGHT_PX
        name = path[-1] if path else "all"
        share = 100.0 * weights[path] / total
        tooltip = f"{';'.join(path) or name} ({_duration(weights[path])}, {share:.2f}%)"
        out.append(
            f"<g><title>{_text(tooltip)}</title>"
            f'<rect x="{x:.3f}" y="{y}" width="{width:.3f}" height="{FRAME_HEIGHT_PX - 1}" '
            f'fill="{_colour(path)}" rx="2" ry="2"/>'
        )
        label = _label(name, width)
        if label:
            out.append(f'<text x="{x + 3:.3f}" y="{y + FRAME_HEIGHT_PX - 5}">{_text(label)}</text>')
        out.append("</g>")
        left = x
        for child in sorted(children.get(path, [])):
            lefts[child] = left
            left += weights[child] * scale
        pending.extend(reversed(sorted(children.get(path, []))))
    out.append("</svg>")
    return "\n".join(out) + "\n"
