"""The names of the files a run leaves in its run dir (docs/ARCHITECTURE.md "Run outputs"), each defined once."""

from __future__ import annotations

CONFIG_FILE = "config.yaml"  # the resolved config (hacrl_fed.lifecycle.Run)
INFO_FILE = "run_info.json"  # run ids, transport, status, sessions (hacrl_fed.lifecycle.Run)
SUMMARY_FILE = "summary.txt"  # the final per-org table (hacrl_fed.lifecycle.Run)
ERROR_LOG = "error.log"  # the traceback of a failed run or command (hacrl_fed.config.report_error)
STATE_FILE = "coordinator_state.json"  # the coordinator's resumable state (hacrl_fed.coordinator.loop)
METRICS_FILE = "metrics.jsonl"  # one JSON object per logged round (hacrl_fed.metrics.RunLogger)
