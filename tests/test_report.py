"""The run report (hacrl_fed/report/, ``hacrl-fed report``) and the samples behind it (hacrl_fed/worker/samples.py).

- a 2-round in-process run with micro agents: every foreign row's fate in samples.jsonl agrees with the intake
  ledger's counters in metrics.jsonl, and the learner × source matrix equals them;
- the page of that run renders in headless Chromium (Debian's ``chromium``; skipped with a reason where it is
  missing, ``.ci/run`` installs it) with no console message, every chart with points and the viewer with rows; a
  screenshot is kept under the test's tmp path (printed);
- hostile rollout text (script tags, HTML, ``<!--``, a 100 KB line) is shown as text and runs nothing;
- a 150-round, 3-org demo's samples stay within their cap and its report within 5 MB.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from hacrl_fed.cli import main as cli_main
from hacrl_fed.config import load_config
from hacrl_fed.coordinator import Coordinator
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.metrics import RunLogger, read_metrics
from hacrl_fed.report import render_page, write_report
from hacrl_fed.report.data import intake_matrix, report_data
from hacrl_fed.report.page import embed_json
from hacrl_fed.types import Prompt, Rollout, RoundPlan, SamplingParams
from hacrl_fed.worker import build_worker
from hacrl_fed.worker import samples
from hacrl_fed.worker.samples import SampleBook, samples_path

ORGS = [{"id": "acme", "model": {"zoo": "micro-qwen-char"}}, {"id": "globex", "model": {"zoo": "micro-gpt2-bpe"}}]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
CHARTS = ("chart-eval", "chart-reward", "chart-capability", "chart-events", "chart-phases", "matrix-table")


def demo_cfg():
    return load_config({
        "name": "report", "seed": 0, "orgs": ORGS, "algorithm": {"name": "hacpo"},
        "trainer": {"lr": 1e-3, "minibatch_size": 64, "micro_batch_size": 32,
                    # peer_sample under a budget: some foreign rows kept, some dropped (failures too: micro agents
                    # rarely succeed)
                    "selection": {"rule": "peer_sample", "budget_multiple": 0.5},
                    "outcome_guard": {"every": 1, "val_size": 8, "final_size": 8}},
        "generation": {"num_samples": 4, "max_new_tokens": 12, "eval_max_new_tokens": 12},
        "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 4},
        "federation": {"rounds": 2, "prompts_per_round": 4, "eval_every": 1, "min_orgs": 1},
    })  # fmt: skip


def _every_row_sampled(mp: pytest.MonkeyPatch, rows: int = 64) -> None:
    """Every row of a small run in samples.jsonl (the fixed sample sizes raised): the fates can be counted."""
    mp.setattr(samples, "OWN_PER_ROUND", rows)
    mp.setattr(samples, "FOREIGN_PER_ROUND", rows)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    cfg = demo_cfg()
    run_dir = tmp_path_factory.mktemp("report-run")
    with pytest.MonkeyPatch.context() as mp:
        _every_row_sampled(mp)
        workers = {o.id: build_worker(cfg, o.id, run_dir=run_dir) for o in cfg.orgs}
        with RunLogger(run_dir, tensorboard=False) as logger:
            Coordinator(cfg, InProcessTransport(workers), run_dir, logger=logger).run()
    return run_dir


def _samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(run_dir.glob("orgs/*/samples.jsonl")) for line in p.open()]


# -- samples and the ledger ---------------------------------------------------------------------------------------


def test_the_matrix_and_every_sampled_fate_equal_the_ledger_counters(run_dir):
    records = read_metrics(run_dir)
    matrix = intake_matrix(records)
    assert set(matrix) == {"acme", "globex"} and matrix["acme"].keys() == {"globex"}
    rows = [r for r in _samples(run_dir) if r["kind"] == "foreign"]
    for learner, by_source in matrix.items():
        for source, cell in by_source.items():
            # the ledger balances, and its received is what the trust screen counted
            assert cell["received"] == cell["kept"] + sum(cell["dropped"].values())
            trust = sum(r.get(f"{learner}/trust/{source}/received", 0) for r in records)
            assert cell["received"] == trust > 0
            # every row was sampled: its fate counts equal the matrix's (kept, and dropped per stage/reason)
            mine = [r for r in rows if r["learner"] == learner and r["source"] == source]
            assert len(mine) == cell["received"]
            assert sum(r["fate"] == "kept" for r in mine) == cell["kept"]
            for rec in records[1:]:
                _check_round_fates(learner, source, rec, [r for r in mine if r["round"] == rec["round"]])
    kept = sum(c["kept"] for by in matrix.values() for c in by.values())
    selected = sum(v for r in records for k, v in r.items() if re.fullmatch(r"[^/]+/select/[^/]+/selected", k))
    assert 0 < kept <= selected  # the budget left some rows to train on
    assert any(c["dropped"].get("select/dropped_budget") for by in matrix.values() for c in by.values())


def _check_round_fates(learner: str, source: str, rec: dict, rows: list[dict]) -> None:
    """One round's rows of (learner, source) against that round's ledger counters: the kept count; per stage the
    dropped count; per row its reason, or (where the ledger counted several reasons of that stage for the source, and
    cannot say which row had which) exactly those reasons."""
    prefix = f"{learner}/intake/{source}/"
    assert len(rows) == rec.get(prefix + "received", 0)
    assert sum(r["fate"] == "kept" for r in rows) == rec.get(prefix + "kept", 0)
    by_stage: dict[str, Counter] = {}
    for k, v in rec.items():
        if k.startswith(prefix + "dropped/") and v:
            stage, why = k[len(prefix + "dropped/") :].split("/")
            by_stage.setdefault(stage, Counter())[why] = int(v)
    dropped = [r for r in rows if r["fate"] == "dropped"]
    assert Counter(r["stage"] for r in dropped) == Counter({s: sum(c.values()) for s, c in by_stage.items()})
    for stage, reasons in by_stage.items():
        mine = [r["reason"] for r in dropped if r["stage"] == stage]
        if len(reasons) == 1:
            assert mine == [*reasons] * len(mine)
        else:
            assert set(mine) == {"|".join(sorted(reasons))}


def test_own_samples_carry_what_the_issue_asks_for(run_dir):
    own = [r for r in _samples(run_dir) if r["kind"] == "own"]
    assert {r["org"] for r in own} == {"acme", "globex"} and {r["round"] for r in own} == {1, 2}
    for r in own:
        assert r["source"] == r["org"] and r["stop_reason"] in ("stop", "length") and 0 <= r["reward"] <= 1
        assert isinstance(r["prompt"], str) and r["prompt"] and r["length"] >= 1


def test_samples_respect_their_cap_over_150_rounds_and_the_report_stays_under_5mb(tmp_path, monkeypatch):
    cfg = load_config({
        "name": "big", "orgs": [{"id": o, "model": {"zoo": "micro-qwen-char"}} for o in ("acme", "globex", "initech")],
        "federation": {"rounds": 150, "prompts_per_round": 16},
    })  # fmt: skip
    _every_row_sampled(monkeypatch, 4096)  # far more rows than fit: the cap decides
    cap = samples.MAX_BYTES
    prompts = tuple(Prompt(i, (), str(i)) for i in range(16))
    records = []
    for org in ("acme", "globex", "initech"):
        book = SampleBook(cfg, org, tmp_path)
        for t in range(1, 151):
            plan = RoundPlan("run", t, "arithmetic", prompts, SamplingParams())
            text = "7+5=12 " * 200  # cut at MAX_TEXT_CHARS
            rollouts = [Rollout(org, t, i % 16, i // 16, text, "length", 0.5, -3.0, 64) for i in range(128)]
            book.record_generate(plan, rollouts)
            assert samples_path(tmp_path, org).stat().st_size <= book.allowance(t) <= cap
        size = samples_path(tmp_path, org).stat().st_size
        assert 0.97 * cap < size <= cap  # filled to its cap, not beyond
        rounds = {json.loads(line)["round"] for line in samples_path(tmp_path, org).open()}
        assert rounds == set(range(1, 151))  # every round kept its share
    for t in range(151):
        rec = {"round": t, "eval/mean_accuracy": 0.5}
        for org in ("acme", "globex", "initech"):
            rec |= {f"eval/{org}/accuracy": 0.5, f"round/{org}/accuracy": 0.4, f"capability/{org}": 0.4,
                    f"security/{org}/excluded": 0, f"{org}/time/generate": 1.0, f"{org}/time/train": 2.0,
                    f"{org}/outcome/validated": 1, f"{org}/screen/x/dropped_low_likelihood": 3}  # fmt: skip
            rec |= {f"{org}/intake/{s}/received": 256 for s in ("acme", "globex", "initech") if s != org}
        records.append(rec)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    page = write_report(tmp_path)
    assert page.stat().st_size <= 5_000_000, page.stat().st_size
    assert len(report_data(tmp_path)["samples"]) > 1000


# -- the page -------------------------------------------------------------------------------------------------


def _chromium(page: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    assert CHROMIUM is not None
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
           f"--user-data-dir={out / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
           "--virtual-time-budget=10000", *extra, page.as_uri()]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)


def _dom(page: Path, out: Path) -> tuple[str, dict, str]:
    """The DOM after the page's script ran, the status element's attributes and chromium's console lines."""
    res = _chromium(page, out, "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    m = re.search(r'<span id="status"([^>]*)>', res.stdout)
    assert m, "no status element in the rendered DOM"
    attrs = {k: html.unescape(v) for k, v in re.findall(r'([\w-]+)="([^"]*)"', m.group(1))}
    console = "\n".join(line for line in res.stderr.splitlines() if "CONSOLE" in line)
    return res.stdout, attrs, console


@needs_chromium
def test_the_report_renders_every_section_in_chromium(run_dir, capsys):
    assert cli_main(["report", str(run_dir)]) == 0
    page = run_dir / "report.html"
    assert capsys.readouterr().out.strip() == str(page)
    text = page.read_text()
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
    dom, status, console = _dom(page, run_dir)
    assert status.get("data-state") == "ok", status
    assert not console, f"console messages: {console}"
    counts = json.loads(status["data-counts"])
    for chart in CHARTS:
        assert counts.get(chart, 0) > 0, f"{chart} has no data points: {counts}"
    assert counts["viewer-table"] == min(len(_samples(run_dir)), 200) > 0
    assert dom.count('class="pt"') >= sum(counts[c] for c in CHARTS if c.startswith("chart-"))
    assert dom.count('class="sample-row"') == counts["viewer-table"]
    shot = run_dir / "report.png"
    res = _chromium(page, run_dir, f"--screenshot={shot}", "--window-size=1280,2200", "--hide-scrollbars")
    assert res.returncode == 0 and shot.stat().st_size > 10_000
    print(f"report screenshot: {shot}")


def test_a_report_of_a_run_dir_without_metrics_is_a_one_line_exit_2(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


HOSTILE = [
    '</script><script>document.title="pwned"</script>',
    '<img src=x onerror="document.title=\'pwned\'"><b>bold</b>',
    "<!-- <script> --> \u2028\u2029 &amp; ]]> {{x}}",
    "A" * 100_000,
]


def test_embedded_json_cannot_close_its_element():
    text = embed_json({"x": HOSTILE})
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"x": HOSTILE}


@needs_chromium
def test_hostile_rollout_text_is_shown_as_text(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"round": 0, "eval/acme/accuracy": 0.1}) + "\n")
    org = tmp_path / "orgs" / "acme"
    org.mkdir(parents=True)
    rows = [{"kind": "own", "org": "acme", "run_id": "r", "round": 1, "source": "acme", "prompt_id": i,
             "sample_index": 0, "prompt": text, "response": text, "reward": 1.0, "stop_reason": "stop",
             "length": 3} for i, text in enumerate(HOSTILE)]  # fmt: skip
    (org / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = write_report(tmp_path)
    dom, status, console = _dom(page, tmp_path)
    assert status.get("data-state") == "ok", status
    assert not console, console
    assert "<title>hacrl-fed report:" in dom and "pwned" not in dom.split("</title>")[0]
    assert dom.count("<script") == 2  # the data and the page's own script: nothing the rows carried
    assert "<img" not in dom and "<b>" not in dom
    assert "&lt;/script&gt;&lt;script&gt;document.title" in dom  # shown, as text
    assert "A" * 100_000 in dom
    assert dom.count('class="sample-row"') == len(HOSTILE)


def test_the_page_is_built_from_data_alone():
    page = render_page({"name": "<x>", "orgs": ["<o>"], "header": [], "samples": []})
    assert "<title>hacrl-fed report: &lt;x&gt;</title>" in page and "<o>" not in page


def test_the_samples_go_to_a_wandb_table(run_dir):
    wandb = pytest.importorskip("wandb")
    from hacrl_fed.loggers.wandb import SAMPLE_COLUMNS, WandbSink
    from hacrl_fed.report import finish_report

    class Run:  # a W&B run's log(), as WandbSink calls it
        logged: list = []

        def log(self, data, step=None):
            self.logged.append(data)

    run = Run()
    assert finish_report(run_dir, [WandbSink(run)]) == run_dir / "report.html"
    (entry,) = run.logged
    table = entry["samples"]
    assert isinstance(table, wandb.Table) and list(table.columns) == list(SAMPLE_COLUMNS)
    samples = _samples(run_dir)
    assert len(table.data) == len(samples)
    assert table.data[0][SAMPLE_COLUMNS.index("response")] == samples[0]["response"]


@pytest.mark.slow  # a second run, in coordinator-blind mode
def test_blind_mode_samples_are_written_by_each_org_with_the_text_it_opened(tmp_path, monkeypatch):
    from test_security_edges import _blind_cfg

    base, run_dir = _blind_cfg(("acme", "globex")), tmp_path / "run"
    fed = {**base.federation.model_dump(), "rounds": 1}
    cfg = load_config({**base.model_dump(), "federation": fed})
    _every_row_sampled(monkeypatch, 999)
    assert cfg.security.encrypt
    workers = {o.id: build_worker(cfg, o.id, run_dir=run_dir) for o in cfg.orgs}
    with RunLogger(run_dir, tensorboard=False) as logger:
        Coordinator(cfg, InProcessTransport(workers), run_dir, logger=logger).run()
    rows = _samples(run_dir)
    own = {(r["source"], r["prompt_id"], r["sample_index"]): r["response"] for r in rows if r["kind"] == "own"}
    foreign = [r for r in rows if r["kind"] == "foreign"]
    assert foreign and {r["learner"] for r in foreign} == {"acme", "globex"}
    for r in foreign:  # the learner wrote the text it decrypted: the source's own text
        assert r["org"] == r["learner"] and r["response"] == own[(r["source"], r["prompt_id"], r["sample_index"])]
    matrix = intake_matrix(read_metrics(run_dir))
    assert len(foreign) == sum(c["received"] for by in matrix.values() for c in by.values())
    texts = {t for t in own.values() if len(t) >= 8}
    coordinator_files = [p for p in run_dir.rglob("*") if p.is_file() and "orgs" not in p.relative_to(run_dir).parts]
    assert texts and not any(t in p.read_text(errors="ignore") for p in coordinator_files for t in texts)


def test_trust_events_are_read_from_the_metrics_keys():
    from hacrl_fed.report.events import trust_events

    records = [
        {"round": 1, "security/evil/excluded": 0, "acme/trust/evil/mismatches": 3, "acme/outcome/rollback": 1,
         "acme/outcome/rebased": 0, "acme/trust/evil/rejected/reward_mismatch": 2},
        {"round": 2, "security/evil/excluded": 1, "round/acme/false_accusation": 1, "globex/outcome/adopted": 1,
         "acme/screen/evil/dropped_low_likelihood": 4, "acme/outcome/evil/quarantined": 1},
        {"round": 3, "security/evil/excluded": 1, "eval/acme/accuracy": 0.5},
    ]  # fmt: skip
    got = [(e["round"], e["kind"], e["org"]) for e in trust_events(records)]
    assert got == [
        (1, "rollback", "acme"), (1, "accusation", "acme"), (1, "trust drop", "acme"),
        (2, "quarantine", "acme"), (2, "screen drop", "acme"), (2, "adoption", "globex"),
        (2, "accusation", "acme"), (2, "exclusion", "evil"),  # in key order within a round; excluded: once
    ]  # fmt: skip
    texts = [e["text"] for e in trust_events(records)]
    assert "acme found 3 contradicted rewards in evil's batch" in texts and "evil excluded from the pool" in texts


def test_samples_off_write_nothing(tmp_path):
    cfg = load_config({"orgs": [{"id": "acme", "model": {"zoo": "micro-qwen-char"}}], "samples": {"enabled": False}})
    plan = RoundPlan("run", 1, "arithmetic", (Prompt(0, (), "1"),), SamplingParams())
    SampleBook(cfg, "acme", tmp_path).record_generate(plan, [Rollout("acme", 1, 0, 0, "1", "stop", 1.0, -1.0, 2)])
    assert not samples_path(tmp_path, "acme").exists()
