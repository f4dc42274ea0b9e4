"""The profile report of the IPU Model (docs/semantics.md S-85): ``profile.json`` and
``profile.html``.

Written at compile time into ``<autoReport.directory>/<model name>/`` when the Poplar
engine option ``autoReport.all`` is ``"true"`` (``Options.enableProfiling(dir)`` or
``POPLAR_ENGINE_OPTIONS``). ``profile.json`` holds the figures of
:meth:`~popart_compiler.cost.cost_model.IpuEstimate.summary`; ``profile.html`` is a
self-contained page (inline CSS and SVG, no script, no network) showing the memory of
each IPU by category, the pipeline timeline (forward work green, backward red; the
stage that runs the last forward stage and the first backward stage in one pipeline
cycle is drawn in both) and the largest tensors, with the same figures as text;
``profile.pop`` (the file Poplar tools look for) holds the same JSON.
"""
from __future__ import annotations

import html
import json
import os
from typing import Any, Dict, List

from popart_compiler.cost.cost_model import IpuEstimate
from popart_compiler.cost.memory_model import CATEGORIES
from popart_compiler.errors import backend_error
from popart_compiler.logging import logger

__all__ = ["write_report", "render_html", "FORMAT"]

#: ``format`` field of ``profile.json``.
FORMAT = "poptorch-ipu-model-profile/1"

_COLOURS = dict(zip(CATEGORIES, ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                                 "#edc948", "#b07aa1", "#ff9da7", "#9c755f")))
_FORWARD, _BACKWARD = "#59a14f", "#e15759"
_STYLE = """
body{font-family:sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;
text-align:right}th{background:#f3f3f3}td.l,th.l{text-align:left}
.bar{display:flex;height:22px;border:1px solid #888;width:900px;position:relative}
.bar div{height:100%}.cap{font-size:12px;margin:2px 0 10px}.over{color:#c00;font-weight:bold}
.legend span{display:inline-block;margin-right:12px;font-size:12px}
.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-1px}
"""


def _b(n: int) -> str:
    return f"{int(n):,}"


def _memory_section(summary: Dict[str, Any]) -> List[str]:
    out = ["<h2>Memory per IPU</h2>", '<div class="legend">']
    out += [f'<span><i style="background:{c}"></i>{html.escape(k)}</span>'
            for k, c in _COLOURS.items()]
    out.append("</div>")
    scale = max([m["capacity"] for m in summary["memory"]] +
                [m["total"] for m in summary["memory"]]) or 1
    for m in summary["memory"]:
        out.append(f"<h3>IPU {m['ipu']}</h3><div class=\"bar\">")
        for key, value in m["categories"].items():
            if value:
                out.append(f'<div title="{html.escape(key)}: {_b(value)} bytes" '
                           f'style="width:{100 * value / scale:.3f}%;'
                           f'background:{_COLOURS[key]}"></div>')
        cap = 100 * m["capacity"] / scale
        out.append(f'<div style="position:absolute;left:{cap:.3f}%;top:-4px;height:30px;'
                   'border-left:2px dashed #000"></div></div>')
        state = "fits" if m["fits"] else '<span class="over">does not fit</span>'
        out.append(f'<div class="cap">total {_b(m["total"])} bytes of {_b(m["capacity"])} '
                   f'bytes: {state}; off chip {_b(m["off_chip"])} bytes</div>')
    out.append('<table><tr><th class="l">category</th>' +
               "".join(f"<th>IPU {m['ipu']}</th>" for m in summary["memory"]) + "</tr>")
    for key in CATEGORIES:
        out.append(f'<tr><td class="l">{html.escape(key)}</td>' +
                   "".join(f"<td>{_b(m['categories'][key])}</td>"
                           for m in summary["memory"]) + "</tr>")
    out.append('<tr><th class="l">total</th>' +
               "".join(f"<th>{_b(m['total'])}</th>" for m in summary["memory"]) +
               "</tr></table>")
    return out


def _timeline_section(summary: Dict[str, Any]) -> List[str]:
    cycles = summary["cycles"]
    schedule = cycles["schedule"]
    ipus = sorted({w["ipu"] for p in schedule for w in p["work"]}) or [0]
    width, row = 900, 26
    total = sum(p["cycles"] for p in schedule) or 1
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 60}" '
           f'height="{row * len(ipus) + 20}">']
    for i, ipu in enumerate(ipus):
        svg.append(f'<text x="0" y="{i * row + 17}" font-size="12">IPU {ipu}</text>')
    x = 0.0
    for p in schedule:
        offsets = {ipu: 0.0 for ipu in ipus}
        for w in p["work"]:
            y = ipus.index(w["ipu"]) * row
            label = f'{w["stage"]}, micro-batch {w["micro_batch"]}' + \
                (f' (×{p["repeat"]} steady cycles)' if p["repeat"] > 1 else "")
            # a merged stage (forward+backward on one IPU) is drawn in both colours
            start = x + offsets[w["ipu"]]
            for part, spent, colour in (("forward", w["forward_cycles"], _FORWARD),
                                        ("backward", w["cycles"] - w["forward_cycles"],
                                         _BACKWARD)):
                if spent <= 0 and not (part == "forward" and w["cycles"] <= 0):
                    continue
                left = 60 + width * start / total
                span = max(1.0, width * spent / total)
                text = f"{label}: {part} {_b(spent)} cycles"
                svg.append(f'<rect x="{left:.2f}" y="{y + 3}" width="{span:.2f}" '
                           f'height="20" fill="{colour}" stroke="#fff"><title>'
                           f"{html.escape(text)}</title></rect>")
                start += spent
            offsets[w["ipu"]] += w["cycles"]
        x += p["cycles"]
    svg.append("</svg>")
    out = ["<h2>Pipeline timeline</h2>",
           f"<p>One {'weight update' if summary['training'] else 'run'}: "
           f"{_b(cycles['pipeline'])} pipeline cycles "
           f"({len(schedule)} distinct pipeline steps; steady-state steps are drawn once "
           f"and repeated), pipeline efficiency {cycles['pipeline_efficiency']:.4f}, "
           f"weight update {_b(cycles['weight_update'])} cycles.</p>"]
    out += svg
    out.append(f'<div class="legend"><span><i style="background:{_FORWARD}"></i>forward'
               f'</span><span><i style="background:{_BACKWARD}"></i>backward</span></div>')
    out.append('<table><tr><th class="l">stage</th><th>IPU</th><th>cycles per '
               'micro-batch</th><th>forward</th><th>backward</th><th>balance</th></tr>')
    for s in cycles["stages"]:
        out.append(f'<tr><td class="l">{html.escape(s["name"])}</td><td>{s["ipu"]}</td>'
                   f'<td>{_b(s["cycles"])}</td><td>{_b(s["forward_cycles"])}</td>'
                   f'<td>{_b(s["cycles"] - s["forward_cycles"])}</td>'
                   f'<td>{s["balance"]:.4f}</td></tr>')
    out.append("</table>")
    return out


def _tensors_section(summary: Dict[str, Any]) -> List[str]:
    out = ["<h2>Largest tensors</h2>", '<table><tr><th>IPU</th><th class="l">tensor</th>'
           '<th class="l">category</th><th>bytes</th></tr>']
    for m in summary["memory"]:
        for t in m["largest"]:
            out.append(f'<tr><td>{m["ipu"]}</td><td class="l">{html.escape(t["name"])}</td>'
                       f'<td class="l">{html.escape(t["category"])}</td>'
                       f'<td>{_b(t["bytes"])}</td></tr>')
    out.append("</table>")
    return out


def _defaults_section(summary: Dict[str, Any]) -> List[str]:
    """The options PopTorch's compiler set by itself (``implicit_defaults``)."""
    defaults = summary.get("implicit_defaults") or {}
    out = ["<h2>Options set by default</h2>",
           '<table><tr><th class="l">option</th><th class="l">value</th></tr>']
    out += [f'<tr><td class="l">{html.escape(k)}</td><td class="l">{html.escape(str(v))}'
            f'</td></tr>' for k, v in defaults.items()]
    out.append("</table>")
    return out


def render_html(report: Dict[str, Any]) -> str:
    """The self-contained HTML page of a ``profile.json`` dictionary."""
    c = report["cycles"]
    t = report["target"]
    head = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>IPU Model profile: {html.escape(report['model_name'])}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>IPU Model profile: {html.escape(report['model_name'])}</h1>",
        f"<p>Target {html.escape(t['name'])}: {_b(t['tiles'])} tiles × "
        f"{_b(t['sram_per_tile'])} bytes = {_b(t['memory_per_ipu'])} bytes per IPU, "
        f"clock {t['clock_hz'] / 1e9:.2f} GHz. {report['replicas']} replica(s), "
        f"micro-batch {report['micro_batch']}, "
        f"{'training' if report['training'] else 'inference'}.</p>",
        f"<p>Estimated cycles per run: <b>{_b(c['run'])}</b>; estimated throughput "
        f"<b>{c['samples_per_second']:,.1f}</b> samples/s; "
        f"{'fits' if report['fits'] else 'does not fit'} in memory.</p>"]
    host = report.get("host")
    if host:
        head.append(
            f"<p>A call ({_b(host['samples_per_call'])} samples): "
            f"{host['seconds_per_call'] * 1e3:,.3f} ms as a Python loop of calls sees it "
            f"(device {host['device'] * 1e3:,.3f} ms, call {host['call'] * 1e3:,.3f} ms, "
            f"inputs {host['inputs'] * 1e3:,.3f} ms, outputs {host['outputs'] * 1e3:,.3f} "
            f"ms): <b>{host['samples_per_second']:,.1f}</b> samples/s.</p>")
    body = _memory_section(report) + _timeline_section(report) + \
        _tensors_section(report) + _defaults_section(report)
    return "\n".join(head + body + ["</body></html>", ""])


def write_report(directory: str, estimate: IpuEstimate, model_name: str,
                 training: bool) -> str:
    """Write ``profile.json``, ``profile.html`` and ``profile.pop`` into ``directory``
    (created if needed).

    Args:
        directory: ``<autoReport.directory>/<model name>``.
        estimate: the compiled program's estimate.
        model_name: ``Options.modelName`` (or ``"training"`` / ``"inference"``).
        training: whether the program trains.

    Returns:
        The path of ``profile.json``.

    Raises:
        Error: ``directory`` cannot be created or written (e.g. a file is in the way).
    """
    report = {"format": FORMAT, "model_name": model_name, "training": training,
              **estimate.summary(),
              "implicit_defaults": {d.key: d.shown for d in estimate.defaults}}
    text = json.dumps(report, indent=1)
    path = os.path.join(directory, "profile.json")
    try:
        os.makedirs(directory, exist_ok=True)
        for name, content in (("profile.json", text), ("profile.pop", text),
                              ("profile.html", render_html(report))):
            with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
                f.write(content)
    except OSError as error:
        raise backend_error(
            f"Cannot write the profile report to {directory!r} ({error}): give "
            "Options.enableProfiling (or autoReport.directory in "
            "POPLAR_ENGINE_OPTIONS) a directory that can be created and "
            "written.") from error
    logger.info("Wrote the IPU Model profile report to %s", directory)
    return path
