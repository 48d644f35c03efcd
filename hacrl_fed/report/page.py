"""The run report page: one self-contained HTML file, its data (:func:`hacrl_fed.report.data.report_data`) and
script (``hacrl_fed/assets/report/report.js``) inline, no network (a Content-Security-Policy forbids any fetch).

The data travels as JSON in a ``<script type="application/json">`` element with every ``<``, ``>`` and ``&``
escaped (``\\u003c`` ...), so no text of a rollout can close the element or open a comment; the script reads it with
``JSON.parse`` and writes every value with ``textContent``, so rollout text shows as text.
"""

from __future__ import annotations

import html
import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any

from hacrl_fed.fsio import write_atomic

log = logging.getLogger(__name__)
REPORT_FILE = "report.html"
CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"


def _asset(name: str) -> str:
    return resources.files("hacrl_fed").joinpath("assets", "report", name).read_text(encoding="utf-8")


def embed_json(data: Any) -> str:
    """``data`` as JSON safe inside a ``<script>`` element: ASCII only, ``<``, ``>``, ``&`` as ``\\u`` escapes."""
    text = json.dumps(data, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


BODY = """<header>
<h1>hacrl-fed run report: {name}</h1>
<div class="meta">rounds 0–{rounds} · orgs {orgs} · written {generated} · <span id="status" data-state="loading">
the page's script did not run</span></div>
</header>
<section id="overview"><h2>Every org: before → after</h2><table id="header-table"></table></section>
<div class="grid">
<section><h2>Held-out accuracy (greedy)</h2><div class="chart" id="chart-eval"></div></section>
<section><h2>Train reward (mean reward of its accepted rollouts)</h2>
<div class="chart" id="chart-reward"></div></section>
<section><h2>Capability estimates P̂</h2><div class="chart" id="chart-capability"></div></section>
<section><h2>Time per phase (mean s per round)</h2><div class="chart" id="chart-phases"></div></section>
</div>
<section id="matrix"><h2>Who learned from whom: foreign rows per learner × source (whole run)</h2>
<p class="meta">From each learner's intake ledger (<code>&lt;learner&gt;/intake/&lt;source&gt;/...</code> in
metrics.jsonl): rows received, kept (trained on) and dropped per stage/reason.</p>
<table id="matrix-table"></table></section>
<section id="events"><h2>Trust events</h2><div class="chart" id="chart-events"></div>
<div class="filters"><label>kind<select id="event-kind"><option value="">all</option></select></label>
<span id="events-count"></span></div><table id="events-table"></table></section>
<section id="viewer"><h2>Rollouts (samples.jsonl of each org)</h2>
<p class="meta" id="samples-info"></p>
<div class="filters">
<label>org<select id="f-org"><option value="">all</option></select></label>
<label>fate<select id="f-fate"><option value="">all</option><option value="own">own</option>
<option value="kept">foreign, kept</option><option value="dropped">foreign, dropped</option></select></label>
<label>round ≥<input id="f-round-min" type="number"></label><label>round ≤<input id="f-round-max" type="number"></label>
<label>reward ≥<input id="f-reward-min" type="number" step="0.1"></label>
<label>reward ≤<input id="f-reward-max" type="number" step="0.1"></label>
<label>text contains<input id="f-text" type="search"></label>
</div>
<div id="viewer-count"></div><table id="viewer-table"></table></section>
<section><h2>summary.txt</h2><pre id="summary"></pre></section>"""


def render_page(data: dict[str, Any]) -> str:
    """The whole page for ``data`` (:func:`~hacrl_fed.report.data.report_data`)."""
    esc = html.escape
    body = BODY.format(
        name=esc(str(data.get("name", ""))),
        rounds=int(data.get("rounds", 0)),
        orgs=esc(", ".join(map(str, data.get("orgs", [])))),
        generated=esc(str(data.get("generated", ""))),
    )
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
        f"<title>hacrl-fed report: {esc(str(data.get('name', '')))}</title>\n"
        f"<style>{_asset('report.css')}</style></head><body>\n{body}\n"
        f'<script type="application/json" id="report-data">{embed_json(data)}</script>\n'
        f"<script>{_asset('report.js')}</script>\n</body></html>\n"
    )


def write_report(run_dir: str | Path) -> Path:
    """Write ``<run dir>/report.html`` for the run as it is now (atomically: a reader never sees half a page)."""
    from hacrl_fed.report.data import report_data

    path = Path(run_dir) / REPORT_FILE
    write_atomic(path, render_page(report_data(run_dir)))
    return path


def finish_report(run_dir: str | Path, sinks: Any = ()) -> Path | None:
    """At the end of a run: ``report.html``, and the samples to every sink that takes them (W&B's table).
    Best effort: a failure is logged, never raised (the run itself succeeded)."""
    from hacrl_fed.report.data import read_samples

    try:
        path = write_report(run_dir)
        rows = None
        for sink in sinks or ():
            if hasattr(sink, "log_samples"):
                rows = read_samples(run_dir)[0] if rows is None else rows
                sink.log_samples(rows)
        return path
    except Exception as err:
        log.warning("report: %s not written (%s: %s)", Path(run_dir) / REPORT_FILE, type(err).__name__, err)
        return None
