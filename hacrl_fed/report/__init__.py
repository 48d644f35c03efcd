"""The run report (``hacrl-fed report RUN_DIR``, also written at the end of every run): ``<run dir>/report.html``,
one self-contained page over ``metrics.jsonl`` and the orgs' ``samples.jsonl``.

- :mod:`~hacrl_fed.report.data`: the sections' data from the run folder;
- :mod:`~hacrl_fed.report.events`: the timeline of trust events;
- :mod:`~hacrl_fed.report.page`: the HTML page with its data and script inline.
"""

from hacrl_fed.report.page import REPORT_FILE, finish_report, render_page, write_report

__all__ = ["REPORT_FILE", "finish_report", "render_page", "write_report"]
