"""The docs in the repository say what the code does, and point only inside the repository.

- every key a real run writes to metrics.jsonl is documented in docs/METRICS.md (a 2-round in-process run with
  micro agents), and so is every metric key each registered policy loss can produce and every rejection reason;
- no tracked file points to design notes outside the repository;
- every relative link in README.md, SECURITY.md and docs/*.md names an existing file (and heading).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from hacrl_fed.algorithm import POLICY_LOSSES, PolicyLossConfig, PolicyLossInputs, advantage_metrics
from hacrl_fed.config import load_config
from hacrl_fed.coordinator import Coordinator
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.metrics import RunLogger, read_metrics
from hacrl_fed.worker import build_worker

ROOT = Path(__file__).resolve().parents[1]
METRICS_MD = ROOT / "docs" / "METRICS.md"
PLACEHOLDERS = {"org", "source", "reason", "why", "phase", "algo", "age", "slice", "round"}
ORGS = [{"id": "acme", "model": {"zoo": "micro-qwen-char"}}, {"id": "globex", "model": {"zoo": "micro-gpt2-bpe"}}]


def make_cfg():
    return load_config({
        "name": "docs", "seed": 0, "orgs": ORGS, "algorithm": {"name": "hacpo"},
        "trainer": {"lr": 1e-3, "minibatch_size": 64, "micro_batch_size": 32,
                    "likelihood_screen": {"enabled": True}},  # its screen/... keys are documented too
        "generation": {"num_samples": 4, "max_new_tokens": 16, "eval_max_new_tokens": 16},
        "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 4},
        "federation": {"rounds": 2, "prompts_per_round": 4, "eval_every": 1, "checkpoint_every": 1,
                       "min_orgs": 1},
        "security": {"screen_min_rows": 16},  # round/<org>/screen_drop_rate from round 1
    })


# -- docs/METRICS.md ---------------------------------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def documented_keys() -> list[str]:
    """The key column of every table in docs/METRICS.md whose first header cell is ``key``."""
    keys, in_key_table, prev = [], False, ""
    for line in METRICS_MD.read_text().splitlines():
        if not line.lstrip().startswith("|"):
            in_key_table, prev = False, ""
            continue
        cells = _cells(line)
        if not prev:  # a table's header row
            in_key_table = cells[0].lower() == "key"
        elif in_key_table and not set(cells[0]) <= set("-: "):
            keys += re.findall(r"`([^`]+)`", cells[0])
        prev = line
    return keys


def key_pattern(doc_key: str) -> re.Pattern:
    """``round/<org>/rejected/<reason>`` -> a regex where each placeholder is one path segment."""
    parts = re.split(r"<([a-z_]+)>", doc_key)
    for name in parts[1::2]:
        assert name in PLACEHOLDERS, f"docs/METRICS.md: unknown placeholder <{name}> in {doc_key!r}"
    return re.compile("".join(re.escape(p) if i % 2 == 0 else r"[^/]+" for i, p in enumerate(parts)))


def undocumented(keys, patterns) -> list[str]:
    return sorted(k for k in keys if not any(p.fullmatch(k) for p in patterns))


@pytest.fixture(scope="module")
def patterns() -> list[re.Pattern]:
    keys = documented_keys()
    assert len(keys) > 80, f"docs/METRICS.md: expected the key tables, found {len(keys)} keys"
    assert len(set(keys)) == len(keys), f"documented twice: {sorted({k for k in keys if keys.count(k) > 1})}"
    return [key_pattern(k) for k in keys]


@pytest.fixture(scope="module")
def run_records(tmp_path_factory) -> list[dict]:
    cfg = make_cfg()
    run_dir = tmp_path_factory.mktemp("docs-run")
    workers = {o.id: build_worker(cfg, o.id, run_dir=run_dir) for o in cfg.orgs}
    with RunLogger(run_dir, tensorboard=False) as logger:
        Coordinator(cfg, InProcessTransport(workers), run_dir, logger=logger).run()
    return read_metrics(run_dir)


def test_every_logged_metric_key_is_documented(run_records, patterns):
    assert [r["round"] for r in run_records] == [0, 1, 2]
    keys = {k for rec in run_records for k in rec}
    assert len(keys) > 100  # the run exercised generation, screening, training, evaluation and checkpoints
    missing = undocumented(keys, patterns)
    assert not missing, f"metrics.jsonl keys missing from docs/METRICS.md: {missing}"


def _loss_inputs(all_self: bool) -> PolicyLossInputs:
    torch.manual_seed(0)
    b, t = 4, 3
    lp = -torch.rand(b, t)
    return PolicyLossInputs(
        token_log_probs=lp, response_mask=torch.ones(b, t), old_seq_log_probs=lp.mean(-1) - 0.05 * torch.rand(b),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        is_self=torch.tensor([True, True, all_self, all_self]), capability_coefficient=torch.ones(b),
        old_token_log_probs=lp - 0.05)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_metric_is_documented(name, patterns):
    """What each algorithm's loss reports ends up as ``<org>/<name>/...`` in metrics.jsonl (via the TrainReport)."""
    _, metrics = POLICY_LOSSES[name](_loss_inputs(all_self=name in ("gspo", "grpo")), 0, PolicyLossConfig())
    keys = {f"acme/{k}" for k in metrics}
    keys |= {f"acme/{k}" for k in advantage_metrics(torch.ones(2), torch.tensor([0, 1]), ["acme", "globex"],
                                                    prefix=name)}
    assert any(k.startswith(f"acme/{name}/") for k in keys)
    missing = undocumented(keys, patterns)
    assert not missing, f"{name} loss metrics missing from docs/METRICS.md: {missing}"


def test_every_selection_count_is_documented(patterns):
    """The docs run uses rule ``all``; a budgeted rule adds ``select/budget``: every key of both is documented."""
    from hacrl_fed.algorithm.selection import select_rows

    sel = select_rows([1.0, 0.0, 1.0], [1, 1, 2], ["globex", "globex", "initech"], [0, 1, 0], {1: [0.0]},
                      "successes", 1, 0)
    keys = {f"acme/{k}" for k in sel.metrics(["globex", "globex", "initech"], 1)}
    assert "acme/select/budget" in keys and "acme/select/initech/dropped_budget" in keys
    missing = undocumented(keys, patterns)
    assert not missing, f"selection metrics missing from docs/METRICS.md: {missing}"


def test_every_rejection_reason_is_documented():
    from hacrl_fed.security.envelope import REASONS

    text = METRICS_MD.read_text()
    section = text[text.index("## Rejection reasons"):]
    documented = set(re.findall(r"`([a-z_]+)`", section))
    sources = [ROOT / "hacrl_fed" / "plan" / "screening.py", ROOT / "hacrl_fed" / "coordinator" / "trust.py",
               ROOT / "hacrl_fed" / "worker" / "guard.py"]
    in_code = set(REASONS)
    for path in sources:
        src = path.read_text()
        in_code |= set(re.findall(r"""rejected\[["']([a-z_]+)["']\]""", src))
        in_code |= set(re.findall(r"""(?:return|reason =) ["']([a-z_]+)["']""", src))
    missing = sorted(in_code - documented)
    assert not missing, f"rejection reasons missing from docs/METRICS.md 'Rejection reasons': {missing}"


# -- links and pointers ------------------------------------------------------------------------------------------


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


def test_no_file_points_outside_the_repository():
    needles = [("shared" + "/design").encode(), ("../" + "shared").encode()]
    hits = [p for p in tracked_files() if any(n in (ROOT / p).read_bytes() for n in needles)]
    assert not hits, f"files pointing to notes outside the repository: {hits}"


def test_design_notes_are_named_by_their_in_repo_path():
    """Outside tests/, the design docs are named with their place in the repo (docs/ALGORITHM.md ...), never by
    the names of notes a clone does not have."""
    gone = [n.encode() for n in ("HACPO" + ".md", "STACK_NOTES" + ".md")]
    arch = ("ARCHITECTURE" + ".md").encode()
    hits = []
    for p in tracked_files():
        if p.startswith(("tests/", "docs/")) or not p.endswith((".py", ".md", ".yaml", ".yml", ".toml", ".proto")):
            continue
        data = (ROOT / p).read_bytes()
        if any(n in data for n in gone) or data.count(arch) != data.count(b"docs/" + arch):
            hits.append(p)
    assert not hits, f"files naming design notes without their docs/ path: {hits}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M)}


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_relative_markdown_links_resolve():
    bad = []
    for md in _doc_files():
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)  # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                bad.append(f"{md.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{md.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_docs_exist_and_license_matches_pyproject():
    for name in ("ALGORITHM.md", "ARCHITECTURE.md", "METRICS.md", "DEPLOYMENT.md"):
        assert (ROOT / "docs" / name).is_file(), name
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    assert (ROOT / "hacrl_fed" / "py.typed").is_file()


def test_algorithm_doc_states_the_config_defaults():
    """Every algorithm field appears in docs/ALGORITHM.md's parameter table with its default from the config
    (hacrl_fed/config/algorithm.py)."""
    from hacrl_fed.config import AlgorithmConfig

    text = (ROOT / "docs" / "ALGORITHM.md").read_text()
    rows = {c[0].strip("`"): c for c in (_cells(l) for l in text.splitlines() if l.startswith("| `algorithm."))}
    wrong = []
    for name, field in AlgorithmConfig.model_fields.items():
        row = rows.get(f"algorithm.{name}")
        if row is None:
            wrong.append(f"algorithm.{name}: not in the table")
            continue
        stated = row[2].strip("`")
        try:
            ok = float(stated) == float(field.default)
        except (TypeError, ValueError):
            ok = stated == str(field.default)
        if not ok:
            wrong.append(f"algorithm.{name}: doc says {stated}, config/algorithm.py says {field.default}")
    assert not wrong, "\n".join(wrong)
