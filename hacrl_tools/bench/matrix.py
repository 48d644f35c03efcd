"""The benchmark matrix (``configs/bench/matrix.yaml``): settings x methods x seeds, planned into cells.

Shared by the matrix runner (:mod:`hacrl_tools.bench.learning`) and the report (:mod:`hacrl_tools.bench.report`),
which both import it (neither imports the other for it). Default paths are relative to the working directory (run
from the repository root, or pass ``--matrix`` / ``--results``); a setting's relative ``model.path`` is resolved
against the working directory too.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from hacrl_fed.algorithm.advantages import ADV_EPS
from hacrl_fed.algorithm.capability import CAPABILITY_FLOOR
from hacrl_fed.coordinator.virtual_clock import BENCH_FIELDS
from hacrl_fed.worker import samples
from hacrl_fed.worker.guard import MAX_ROUND_STEP

# relative to the working directory (the repository root when run from a checkout)
MATRIX = Path("configs") / "bench" / "matrix.yaml"
RESULTS = Path("benchmarks") / "results"
QUICK_RESULTS = Path("benchmarks") / "results-quick"


# ------------------------------------------------------------------------------------------------ the matrix


@dataclass(frozen=True)
class Method:
    name: str
    set: dict[str, Any] = field(default_factory=dict)
    scale: dict[str, float] = field(default_factory=dict)
    same_as: str | None = None
    about: str = ""
    # org id -> dotted fields of that org's entry in the setting's ``orgs`` list (``trainer.selection.rule``): one
    # org's own settings (every org keeps its own rule); a setting without that org skips the cell
    orgs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # a method whose feature the code no longer has: ``{"commit": the last commit with its code, where its committed
    # cells ran (a method still in a group) or before which they ran (one in no group; each cell's JSON names its
    # commit), "why": what was removed}``. It is never run (its cells are skipped, naming the commit to rerun them
    # at); its cells stay readable by the report tools, which read the cells' JSON, not the config. The matrix YAML
    # is the one list of retired methods (:func:`retired_methods`)
    retired: dict[str, str] | None = None


@dataclass
class Matrix:
    path: Path
    settings: dict[str, dict[str, Any]]  # name -> {"config": Path, "about": str}
    methods: dict[str, Method]
    # name -> {"settings": [...], "methods": [...], "ref": the method the group's others are also paired with,
    #          "seeds": the group's own seeds, None for the matrix's}
    groups: dict[str, dict[str, Any]]
    seeds: list[int]
    quick: dict[str, Any]

    def setting_config(self, setting: str) -> Path:
        return self.settings[setting]["config"]


class MatrixError(ValueError):
    """A malformed matrix file (the message names the entry)."""


def load_matrix(path: str | Path = MATRIX) -> Matrix:
    """Parse and check a matrix YAML (see ``configs/bench/matrix.yaml``); config paths are relative to it."""
    path = Path(path)
    data = yaml.safe_load(path.read_text()) or {}
    settings = {}
    for name, s in (data.get("settings") or {}).items():
        if not isinstance(s, dict) or "config" not in s:
            raise MatrixError(f"{path}: settings.{name} needs a 'config'")
        cfg = Path(s["config"])
        settings[name] = {"config": cfg if cfg.is_absolute() else path.parent / cfg, "about": s.get("about", "")}
    methods = {}
    for name, m in (data.get("methods") or {}).items():
        m = m or {}
        unknown = set(m) - {"set", "scale", "same_as", "about", "orgs", "retired"}
        if unknown:
            raise MatrixError(f"{path}: methods.{name}: unknown keys {sorted(unknown)}")
        orgs = {str(o): dict(v or {}) for o, v in (m.get("orgs") or {}).items()}
        methods[name] = Method(
            name,
            dict(m.get("set") or {}),
            dict(m.get("scale") or {}),
            m.get("same_as"),
            m.get("about", ""),
            orgs,
            _retired(path, name, m.get("retired")),
        )
    for m in methods.values():
        if m.same_as is not None and m.same_as not in methods:
            raise MatrixError(f"{path}: methods.{m.name}.same_as={m.same_as!r} is not a method")
    groups = {}
    for name, g in (data.get("groups") or {}).items():
        unknown = set(g) - {"settings", "methods", "ref", "seeds"}
        if unknown:
            raise MatrixError(f"{path}: groups.{name}: unknown keys {sorted(unknown)}")
        g = {
            "settings": list(g.get("settings") or []),
            "methods": list(g.get("methods") or []),
            "ref": g.get("ref"),
            "seeds": [int(s) for s in g["seeds"]] if g.get("seeds") is not None else None,
        }
        if g["ref"] is not None and g["ref"] not in g["methods"]:
            raise MatrixError(f"{path}: groups.{name}.ref: {g['ref']!r} is not one of the group's methods")
        for s in g["settings"]:
            if s not in settings:
                raise MatrixError(f"{path}: groups.{name}: unknown setting {s!r}")
        for m in g["methods"]:
            if m not in methods:
                raise MatrixError(f"{path}: groups.{name}: unknown method {m!r}")
        groups[name] = g
    seeds = [int(s) for s in data.get("seeds") or [0, 1, 2]]
    return Matrix(path, settings, methods, groups, seeds, dict(data.get("quick") or {}))


def retired_methods(matrix: Matrix) -> dict[str, str]:
    """Every retired method of ``matrix`` (its YAML's ``retired:`` entries) -> the last commit with its code."""
    return {name: m.retired["commit"] for name, m in matrix.methods.items() if m.retired is not None}


def _retired(path: Path, name: str, value: Any) -> dict[str, str] | None:
    """A method's ``retired`` entry checked: ``{commit: <7-40 hex digits>, why: <text>}``, or None."""
    if value is None:
        return None
    commit = str(value.get("commit", "")) if isinstance(value, dict) else ""
    if not (7 <= len(commit) <= 40 and all(c in "0123456789abcdef" for c in commit)) or not value.get("why"):
        raise MatrixError(f"{path}: methods.{name}.retired needs a commit (hex) and a why, got {value!r}")
    return {"commit": commit, "why": str(value["why"])}


# ------------------------------------------------------------------------------------------------ cells


@dataclass
class Cell:
    setting: str
    method: str
    seed: int
    group: str
    overrides: dict[str, Any] = field(default_factory=dict)
    config: Any = None  # RunConfig, None when skipped
    config_dict: dict[str, Any] | None = None  # the setting's YAML with bench agent paths made absolute
    agents: list[Path] = field(default_factory=list)  # bench agent dirs this cell needs built
    skip: str | None = None  # why it does not run
    same_as: str | None = None
    hash: str | None = None
    # the benchmark layer: the in-process virtual clock's fields of the method's ``set`` (``federation.virtual_step_s``
    # and the others of hacrl_fed.coordinator.virtual_clock.BENCH_FIELDS), out of the run config since issue 42
    bench: dict[str, Any] = field(default_factory=dict)

    def clock(self) -> Any:
        """The cell's :class:`~hacrl_fed.coordinator.virtual_clock.VirtualClock`."""
        from hacrl_fed.coordinator.virtual_clock import VirtualClock

        return VirtualClock.from_bench(self.bench)

    def stored_config(self) -> dict[str, Any]:
        """The config a cell's JSON records: the run config with the benchmark layer in the ``federation`` section,
        where the run config held those fields until issue 42 (so older cells and the readers of ``config`` agree:
        :func:`same_run_config`, ``scripts/async_bench.py``)."""
        return with_bench(self.config.model_dump(mode="json"), self.bench)

    @property
    def key(self) -> str:
        return f"{self.setting}/{self.method}/seed{self.seed}"

    def path(self, results: Path) -> Path:
        return Path(results) / self.setting / self.method / f"seed{self.seed}.json"


def field_exists(dotted: str) -> bool:
    """Whether ``dotted`` (``algorithm.alpha``) names a field of the run config (``seed``, ``orgs`` included)."""
    from hacrl_fed.config import RunConfig

    model: Any = RunConfig
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            # a dict-valued field (task.params, vllm_kwargs) takes any key below it
            return model is dict
        ann = fields[part].annotation
        if i == len(parts) - 1:
            return True
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        elif getattr(ann, "__origin__", None) is dict or ann is dict:
            model = dict
        else:
            return False
    return True


def _get_dotted(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        data = getattr(data, part)
    return data


def _resolve_model_paths(raw: dict[str, Any]) -> tuple[dict[str, Any], list[Path]]:
    """The setting's YAML with every relative ``model.path`` made absolute (relative to the working directory: the
    repository root), and the bench agent dirs among them (built on demand by
    :func:`hacrl_tools.bench.agents.ensure_agent`)."""
    from hacrl_tools.bench.agents import agent_name

    raw = json.loads(json.dumps(raw))
    agents = []
    for org in raw.get("orgs") or []:
        model = org.get("model") or {}
        if model.get("path"):
            p = Path(model["path"]).expanduser()
            p = p if p.is_absolute() else Path.cwd() / p
            if agent_name(p) is not None:
                agents.append(p)
            if p.exists() or agent_name(p) is not None:
                model["path"] = str(p)
    return raw, agents


def build_cell(
    matrix: Matrix,
    setting: str,
    method: str,
    seed: int,
    group: str,
    *,
    rounds: int | None = None,
    extra: dict[str, Any] | None = None,
) -> Cell:
    """One cell: its overrides, its config (or why it is skipped), its hash."""
    from hacrl_fed.config import ConfigError, config_hash, load_config

    cell = Cell(setting, method, seed, group)
    m = matrix.methods[method]
    if m.retired is not None:
        cell.skip = f"retired: {m.retired['why']}; its cells ran at commit {m.retired['commit']} (rerun there)"
        return cell
    if m.same_as is not None:
        cell.same_as = m.same_as
        cell.skip = f"same config as {m.same_as} (reported from its cells)"
        return cell
    raw = yaml.safe_load(matrix.setting_config(setting).read_text()) or {}
    raw, cell.agents = _resolve_model_paths(raw)
    if (absent := _set_orgs(raw, m.orgs)) is not None:
        cell.skip = f"the setting has no org {absent} (method {method} sets its fields)"
        return cell
    cell.config_dict = raw
    overrides: dict[str, Any] = dict(m.set)
    cell.bench = {k: overrides.pop(k) for k in list(overrides) if k in BENCH_FIELDS}
    missing = [k for k in overrides if not field_exists(k)]
    if missing:
        cell.overrides = overrides
        cell.skip = "needs knob " + ", ".join(missing) + " (not a config field yet)"
        return cell
    overrides.update(extra or {})
    if rounds is not None:
        overrides["federation.rounds"] = int(rounds)
    overrides["seed"] = int(seed)
    overrides["name"] = f"bench-{setting}-{method}"
    try:
        base = load_config(raw, {k: v for k, v in overrides.items() if k not in m.scale})
        for key, factor in m.scale.items():
            value = _get_dotted(base, key) * factor
            overrides[key] = int(round(value)) if isinstance(_get_dotted(base, key), int) else value
        config = load_config(raw, overrides)
        cell.clock().check([o.id for o in config.orgs], config.federation.staleness)
        cell.config = config
    except (ConfigError, ValueError) as err:
        cell.overrides = overrides
        cell.skip = f"config refused: {err}"
        return cell
    except AttributeError as err:
        cell.skip = f"bad scale field: {err}"
        return cell
    cell.overrides = {**overrides, **cell.bench}
    # the cell's label in listings and JSON: only the fields set away from their defaults. Whether a finished cell
    # is this cell compares the resolved configs (cell_status); a change of what the code does with the same
    # config is tracked by each cell's commit (the report lists the training-code files that differ)
    cell.hash = config_hash(
        cell.config, exclude=("run_dir", "name"), relative_to=Path.cwd(), digits=12, exclude_defaults=True
    )
    if cell.bench:  # the benchmark layer is part of what the cell runs
        layer = json.dumps(cell.bench, sort_keys=True)
        cell.hash = hashlib.sha256(f"{cell.hash}|{layer}".encode()).hexdigest()[:12]
    return cell


def with_bench(dumped: dict[str, Any], bench: dict[str, Any], *, defaults: bool = True) -> dict[str, Any]:
    """A dumped run config with the benchmark layer ``bench`` (``{"federation.virtual_step_s": {...}}``) put back
    where the run config held it until issue 42: ``federation.virtual_*``, and each org's ``emulate_slowdown`` 1.0
    (never set in process). ``defaults``: also the fields ``bench`` leaves out, at their old defaults."""
    out = json.loads(json.dumps(dumped))
    fed = out.setdefault("federation", {})
    for key in BENCH_FIELDS:
        name = key.split(".", 1)[1]
        if key in bench or defaults:
            fed[name] = dict(bench.get(key) or {})
    if defaults:
        for org in out.get("orgs") or []:
            org.setdefault("emulate_slowdown", 1.0)
    return out


def _set_orgs(raw: dict[str, Any], orgs: dict[str, dict[str, Any]]) -> str | None:
    """Apply a method's per-org fields to the setting's ``orgs`` entries (in place); the first org id the setting
    lacks, or None."""
    entries = {str(o.get("id")): o for o in raw.get("orgs") or [] if isinstance(o, dict)}
    for org, fields in orgs.items():
        if org not in entries:
            return org
        for key, value in fields.items():
            *path, last = key.split(".")
            node = entries[org]
            for k in path:
                node = node.setdefault(k, {})
            node[last] = value
    return None


def _match(patterns: list[str], setting: str, method: str, group: str) -> bool:
    if not patterns:
        return True
    for pat in patterns:
        if "/" in pat:
            s_pat, _, m_pat = pat.partition("/")
            if fnmatch.fnmatchcase(setting, s_pat or "*") and fnmatch.fnmatchcase(method, m_pat or "*"):
                return True
        elif fnmatch.fnmatchcase(setting, pat) or fnmatch.fnmatchcase(group, pat):
            return True
    return False


def plan_cells(
    matrix: Matrix,
    *,
    only: Iterable[str] = (),
    seeds: Iterable[int] | None = None,
    rounds: int | None = None,
    extra: dict[str, Any] | None = None,
    quick: bool = False,
) -> list[Cell]:
    """Every cell of the matrix (or of ``matrix.quick``) selected by ``only`` (``SETTING``, ``GROUP``,
    ``SETTING/METHOD``, shell patterns allowed), in group, setting, method, seed order, without duplicates.

    A pair's seeds are ``seeds`` when given, else the quick matrix's, else every seed of the groups that hold it
    (a group's own ``seeds``, or the matrix's): a group may run more seeds of pairs another group holds too, and
    the pair keeps the first group's name."""
    only = list(only)
    q = matrix.quick if quick else {}
    extra = {**(q.get("set") or {}), **(extra or {})}
    fixed = list(seeds) if seeds is not None else (list(q["seeds"]) if q.get("seeds") else None)
    pairs: dict[tuple[str, str], tuple[str, list[int]]] = {}  # (setting, method) -> (first group, seeds)
    for group, g in matrix.groups.items():
        for setting in g["settings"]:
            if quick and setting not in (q.get("settings") or []):
                continue
            for method in g["methods"]:
                if quick and method not in (q.get("methods") or []):
                    continue
                if not _match(only, setting, method, group):
                    continue
                first, had = pairs.get((setting, method), (group, []))
                more = fixed if fixed is not None else (g["seeds"] or matrix.seeds)
                pairs[(setting, method)] = (first, had + [s for s in more if s not in had])
    return [
        build_cell(matrix, setting, method, seed, group, rounds=rounds, extra=extra)
        for (setting, method), (group, seed_list) in pairs.items()
        for seed in seed_list
    ]


def cell_status(cell: Cell, results: Path) -> str:
    """``skip`` | ``done`` | ``stale`` (another config) | ``todo``.

    A cell is done when its JSON's resolved config (``config``) holds what this cell's config holds: every field
    equal, and a field the JSON lacks (added to the schema later) at its default here (:func:`same_run_config`).
    So adding a field keeps finished cells, while changing a default the cell relied on, or a method's override,
    makes it stale; pinning a field at the value a cell ran with keeps it. A JSON without ``config`` falls back
    to the config hash.
    """
    if cell.skip is not None:
        return "skip"
    path = cell.path(results)
    if not path.is_file():
        return "todo"
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return "stale"
    if isinstance(old.get("config"), dict) and cell.config is not None:
        return "done" if same_run_config(old["config"], cell.config, cell.bench) else "stale"
    return "done" if old.get("config_hash") == cell.hash else "stale"


def _comparable(data: dict[str, Any]) -> dict[str, Any]:
    """A dumped run config without ``run_dir`` and ``name``, a bench agent's path replaced by its name (the same
    agent lives under another checkout's root in every worktree)."""
    from hacrl_tools.bench.agents import agent_name

    data = {k: v for k, v in json.loads(json.dumps(data)).items() if k not in ("run_dir", "name")}
    for org in data.get("orgs") or []:
        model = org.get("model") or {}
        for key in ("path", "tokenizer"):
            if isinstance(model.get(key), str) and (name := agent_name(Path(model[key]))) is not None:
                model[key] = f"bench-agent:{name}"
    return data


def same_run_config(stored: dict[str, Any], cfg: Any, bench: dict[str, Any] | None = None) -> bool:
    """Whether a cell that ran with the resolved config ``stored`` (its JSON's ``config``) ran ``cfg``: every field
    of ``cfg`` equal to the stored one, or, where ``stored`` lacks the field (the cell predates it), ``cfg`` at the
    value that field's absence stands for: its ``absent_means`` where the schema records one (a field whose default
    changed after it was added: ``trainer.selection.budget_split``; for a section, the fields its absence fixes:
    ``trainer.outcome_guard`` off), else the schema's default; a section switched off (``enabled: false``) in both
    is the same whatever its other fields; a stored field
    ``cfg`` no longer has is a difference unless it was measured and removed at the value that is today's only
    behaviour (:data:`REMOVED_FIELDS`)."""
    current = _comparable(with_bench(cfg.model_dump(mode="json"), bench or {}))
    set_fields = cfg.model_dump(mode="json", exclude_defaults=True)
    non_default = _comparable(with_bench(set_fields, bench or {}, defaults=False))
    return _same(_comparable(stored), current, non_default, cfg)


def _absent_ok(model: Any, key: str, value: Any, non_default: dict[str, Any]) -> bool:
    """Whether field ``key`` of ``model`` (a config section, or anything else: no schema) at ``value`` is what a
    stored config without the field ran with (:func:`same_run_config`)."""
    info = type(model).model_fields.get(key) if isinstance(model, BaseModel) else None
    extra = info.json_schema_extra if info is not None else None
    if isinstance(extra, dict) and "absent_means" in extra:
        means = extra["absent_means"]
        if isinstance(means, dict) and isinstance(value, dict):  # a section: the fields its absence fixes
            return all(value.get(k) == v for k, v in means.items())
        return bool(value == means)
    return key not in non_default  # a new field: at its default


# Fields the run config no longer has (issue 42), each at the value today's code runs with: a stored cell config that
# holds one at that value ran what today's code runs (any other value: a difference). Dotted, ``orgs[]`` for an org.
REMOVED_FIELDS: dict[str, Any] = {
    "trainer.likelihood_screen.norm": "per_byte",
    "trainer.likelihood_screen.quantile": 0.0,
    "trainer.likelihood_screen.claim_margin_nats": 0.5,
    "trainer.likelihood_screen.min_scale": 0.05,
    "trainer.likelihood_screen.history_decay": 0.8,
    "trainer.likelihood_screen.min_rows": 4,
    "algorithm.cross_staleness": "band",
    "algorithm.cross_weight_mode": "filter",
    "algorithm.cross_weight_min": 0.8,
    "algorithm.cross_weight_max": 1.0,
    "trainer.teach": {"enabled": False},
    "trainer.outcome_guard.struck_bar": "slack",
    "trainer.outcome_guard.shadow_gate": True,
    # fixed behaviour or module constants since issue 42's field count (hacrl_fed/config: each section's
    # removed_fields says what replaced them)
    "algorithm.grpo_loss_agg_mode": "token-mean",
    "algorithm.capability_floor": CAPABILITY_FLOOR,
    "algorithm.adv_eps": ADV_EPS,
    "trainer.skip_no_gradient_rows": True,
    "trainer.forward": "auto",
    "samples.own_per_round": samples.OWN_PER_ROUND,
    "samples.foreign_per_round": samples.FOREIGN_PER_ROUND,
    "samples.max_text_chars": samples.MAX_TEXT_CHARS,
    "samples.max_bytes": samples.MAX_BYTES,
    "orgs[].model.cache_dir": None,
    "generation.enforce_eager": False,
    "security.max_round_step": MAX_ROUND_STEP,
}


def _removed_ok(stored: dict[str, Any], keys: set[str], path: str) -> bool:
    """Whether every one of ``keys`` (stored fields the config no longer has, under ``path``) is a removed field at
    the value today's code runs with (:data:`REMOVED_FIELDS`; a removed section's entry is a dict of the fields
    that must match, e.g. ``{"enabled": False}``)."""

    def ok(key: str) -> bool:
        expected, value = REMOVED_FIELDS.get(f"{path}{key}", _MISSING), stored[key]
        if isinstance(expected, dict) and isinstance(value, dict):
            return all(value.get(k, _MISSING) == v for k, v in expected.items())
        return bool(expected == value)

    return all(ok(k) for k in keys)


_MISSING = object()


def _same(stored: Any, current: Any, non_default: Any, model: Any = None, path: str = "") -> bool:
    """``current`` (a dumped config, ``model`` the object it was dumped from where there is one) against
    ``stored`` (:func:`same_run_config`); ``path``: the dotted prefix of this section (``trainer.``)."""
    if isinstance(current, dict):
        if current.get("enabled") is False and isinstance(stored, dict) and stored.get("enabled") is False:
            return True  # a section switched off in both runs: its other fields change nothing
        if not isinstance(stored, dict) or not _removed_ok(stored, set(stored) - set(current), path):
            return False
        nd = non_default if isinstance(non_default, dict) else {}
        sub = (lambda k: getattr(model, k, None)) if isinstance(model, BaseModel) else (lambda k: None)
        return all(
            _same(stored[k], v, nd.get(k), sub(k), f"{path}{k}.") if k in stored else _absent_ok(model, k, v, nd)
            for k, v in current.items()
        )
    if isinstance(current, list):
        if not isinstance(stored, list) or len(stored) != len(current):
            return False
        nds: list[Any] = (
            non_default if isinstance(non_default, list) and len(non_default) == len(current) else [None] * len(current)
        )
        models = list(model) if isinstance(model, list) and len(model) == len(current) else [None] * len(current)
        return all(_same(a, b, c, m, path.rstrip(".") + "[].") for a, b, c, m in zip(stored, current, nds, models))
    return stored == current
