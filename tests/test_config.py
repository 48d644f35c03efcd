"""Tests for hacrl_fed.config: YAML loading, defaults, dotted overrides, field-naming errors, per-org merges."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from hacrl_fed.config import (
    AlgorithmConfig,
    ConfigError,
    GenerationConfig,
    RunConfig,
    TrainerConfig,
    load_config,
    org_generation,
    org_trainer,
    parse_overrides,
)

TWO_ORGS_YAML = """
name: demo
seed: 7
algorithm:
  name: gspo
trainer:
  lr: 1.0e-4
  lora:
    r: 16
generation:
  num_samples: 4
  max_new_tokens: 16
task:
  name: arithmetic
  params: {digits: 2}
orgs:
  - id: acme
    model: {zoo: tiny-a}
  - id: globex
    model: {path: /models/globex, dtype: float32}
    seed: 3
    trainer: {lr: 5.0e-5}
    generation: {temperature: 0.7}
federation:
  rounds: 3
  min_orgs: 2
"""


def _write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _minimal(**sections: Any) -> dict[str, Any]:
    """A valid config dict with two zoo orgs, plus ``sections`` merged at the top level."""
    data: dict[str, Any] = {"orgs": [{"id": "a", "model": {"zoo": "tiny"}}, {"id": "b", "model": {"zoo": "tiny"}}]}
    data.update(sections)
    return data


def _error(data: dict[str, Any], overrides: Any = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(data, overrides)
    return str(info.value)


# --- loading -----------------------------------------------------------------------------------------------


def test_load_yaml_file_reads_every_section(tmp_path):
    cfg = load_config(_write(tmp_path, TWO_ORGS_YAML))
    assert isinstance(cfg, RunConfig)
    assert (cfg.name, cfg.seed) == ("demo", 7)
    assert cfg.algorithm.name == "gspo"
    assert cfg.trainer.lr == pytest.approx(1e-4)
    assert cfg.trainer.lora.r == 16
    assert (cfg.generation.num_samples, cfg.generation.max_new_tokens) == (4, 16)
    assert cfg.task.params == {"digits": 2}
    assert [o.id for o in cfg.orgs] == ["acme", "globex"]
    assert cfg.orgs[0].model.zoo == "tiny-a" and cfg.orgs[0].model.path is None
    assert cfg.orgs[1].model.path == "/models/globex" and cfg.orgs[1].model.dtype == "float32"
    assert cfg.orgs[1].seed == 3 and cfg.orgs[0].seed is None
    assert (cfg.federation.rounds, cfg.federation.min_orgs) == (3, 2)


def test_load_accepts_str_path_and_dict(tmp_path):
    path = _write(tmp_path, TWO_ORGS_YAML)
    from_str = load_config(str(path))
    from_dict = load_config(yaml.safe_load(path.read_text()))
    assert from_str == from_dict == load_config(path)


def test_defaults_when_sections_are_omitted():
    cfg = load_config({"orgs": [{"id": "solo", "model": {"zoo": "tiny"}}]})
    assert cfg.algorithm == AlgorithmConfig()
    assert cfg.trainer == TrainerConfig()
    assert cfg.generation == GenerationConfig()
    assert cfg.algorithm.name == "hacpo"
    assert cfg.algorithm.self_clip_low == pytest.approx(3e-4)
    assert cfg.algorithm.cross_clip_delta == pytest.approx(0.2)
    assert cfg.generation.engine == "hf" and cfg.generation.num_samples == 8
    assert cfg.trainer.lora.enabled is False
    assert cfg.federation.transport == "inprocess" and cfg.federation.min_orgs == 1
    assert cfg.task.name == "arithmetic" and cfg.task.params == {}
    assert cfg.orgs[0].trainer == {} and cfg.orgs[0].generation == {}
    assert cfg.orgs[0].model.device == "auto" and cfg.orgs[0].model.trust_remote_code is False


def test_missing_file_is_a_config_error(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="config file not found") as info:
        load_config(missing)
    assert str(missing) in str(info.value)


def test_directory_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_non_mapping_yaml_is_rejected(tmp_path, text):
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(_write(tmp_path, text))


def test_invalid_yaml_syntax_is_a_config_error(tmp_path):
    path = _write(tmp_path, "orgs: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_an_inline_roster_listing_one_org_twice_is_refused_like_a_roster_file(tmp_path):
    k1, k2 = "ed25519:AAAA x25519:BBBB", "ed25519:CCCC x25519:DDDD"  # shapes only: duplicates go first
    roster = f'security:\n  roster:\n    acme: "{k1}"\n    globex: "{k2}"\n    acme: "{k2}"\n'
    path = _write(tmp_path, TWO_ORGS_YAML + roster)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    line = (TWO_ORGS_YAML + roster).splitlines().index(f'    acme: "{k2}"') + 1
    assert str(info.value) == f"{path}: security.roster: 'acme' is listed twice (line {line})"
    assert load_config(_write(tmp_path, TWO_ORGS_YAML + roster.replace(f'    acme: "{k2}"\n', ""))).security.roster == {
        "acme": k1, "globex": k2}


def test_a_key_listed_twice_anywhere_in_a_config_is_refused(tmp_path):
    path = _write(tmp_path, TWO_ORGS_YAML + "federation:\n  rounds: 9\n")
    with pytest.raises(ConfigError, match=r"^.*run.yaml: 'federation' is listed twice \(line \d+\)$"):
        load_config(path)
    path = _write(tmp_path, "orgs:\n  - id: acme\n    seed: 1\n    seed: 2\n")
    with pytest.raises(ConfigError, match=r"orgs\[0\]: 'seed' is listed twice \(line 4\)$"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^override 'security.roster': 'acme' is listed twice \(line 1\)$"):
        load_config(_write(tmp_path, TWO_ORGS_YAML), overrides=["security.roster={acme: a, globex: b, acme: c}"])


def test_empty_yaml_file_reports_missing_orgs(tmp_path):
    with pytest.raises(ConfigError, match="orgs: Field required"):
        load_config(_write(tmp_path, ""))


def test_empty_org_list_is_rejected():
    assert "orgs:" in _error({"orgs": []})


# --- dotted overrides --------------------------------------------------------------------------------------


def test_parse_overrides_list_form_types_values_as_yaml():
    got = parse_overrides(
        ["federation.rounds=3", "trainer.lr=1.0e-5", "trainer.lora.enabled=true", "name=my-run", "model.path=null"]
    )
    assert got == {
        "federation.rounds": 3,
        "trainer.lr": 1e-5,
        "trainer.lora.enabled": True,
        "name": "my-run",
        "model.path": None,
    }
    assert isinstance(got["federation.rounds"], int) and isinstance(got["trainer.lr"], float)


def test_yaml11_exponent_without_dot_still_loads_as_float_field():
    # PyYAML (YAML 1.1) reads "1e-5" as a string; typed fields coerce it, so the run config gets a float.
    assert parse_overrides(["trainer.lr=1e-5"]) == {"trainer.lr": "1e-5"}
    assert load_config(_minimal(), ["trainer.lr=1e-5"]).trainer.lr == pytest.approx(1e-5)


def test_parse_overrides_string_form_splits_on_spaces_and_commas():
    assert parse_overrides("federation.rounds=3 trainer.lr=0.5,seed=4") == {
        "federation.rounds": 3,
        "trainer.lr": 0.5,
        "seed": 4,
    }
    assert parse_overrides("  a=1 ,  b=x  ") == {"a": 1, "b": "x"}


def test_parse_overrides_string_form_keeps_list_values_whole():
    got = parse_overrides("trainer.betas=[0.8, 0.9], trainer.lora.target_modules=[q_proj,v_proj] seed=1")
    assert got == {"trainer.betas": [0.8, 0.9], "trainer.lora.target_modules": ["q_proj", "v_proj"], "seed": 1}


def test_parse_overrides_value_may_contain_equals():
    assert parse_overrides(["name=a=b"]) == {"name": "a=b"}


@pytest.mark.parametrize("empty", [None, [], ""])
def test_parse_overrides_empty(empty):
    assert parse_overrides(empty) == {}


@pytest.mark.parametrize("bad", [["federation.rounds"], ["=3"], "rounds"])
def test_parse_overrides_needs_key_and_equals(bad):
    with pytest.raises(ConfigError, match="section.field=value"):
        parse_overrides(bad)


def test_parse_overrides_bad_yaml_value_names_the_key():
    with pytest.raises(ConfigError, match="trainer.betas"):
        parse_overrides(["trainer.betas=[0.9"])


def test_load_config_applies_dict_and_list_overrides(tmp_path):
    path = _write(tmp_path, TWO_ORGS_YAML)
    cfg = load_config(path, {"federation.rounds": 9, "trainer.lora.enabled": True, "task.params.digits": 4})
    assert cfg.federation.rounds == 9 and cfg.trainer.lora.enabled is True
    assert cfg.trainer.lora.r == 16  # siblings in the file are kept
    assert cfg.task.params == {"digits": 4}
    cfg = load_config(path, ["generation.engine=vllm", "algorithm.alpha=0.5", "seed=11"])
    assert cfg.generation.engine == "vllm" and cfg.algorithm.alpha == 0.5 and cfg.seed == 11


def test_overrides_create_missing_sections():
    cfg = load_config(_minimal(), ["federation.eval_every=0", "algorithm.warmup_rounds=2"])
    assert cfg.federation.eval_every == 0 and cfg.algorithm.warmup_rounds == 2


def test_overrides_are_validated_and_name_the_field():
    assert "federation.rounds" in _error(_minimal(), ["federation.rounds=0"])
    assert "trainer.lr" in _error(_minimal(), {"trainer.lr": "fast"})
    assert "trainer.lrr" in _error(_minimal(), ["trainer.lrr=1"])


def test_override_through_a_non_section_fails():
    with pytest.raises(ConfigError, match="'seed' is not a section"):
        load_config(_minimal(seed=3), ["seed.value=1"])


def test_load_config_does_not_mutate_the_callers_dict():
    data = _minimal(trainer={"lr": 0.1})
    before = copy.deepcopy(data)
    cfg = load_config(data, {"trainer.lr": 0.2, "federation.rounds": 2})
    assert cfg.trainer.lr == 0.2
    assert data == before


# --- errors name the field ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (_minimal(trainer={"lrr": 1e-5}), "trainer.lrr"),
        (_minimal(generation={"top_k": 1, "topk": 1}), "generation.topk"),
        (_minimal(federation={"round": 1}), "federation.round"),
        (_minimal(bogus=1), "bogus"),
        ({"orgs": [{"id": "a", "model": {"zoo": "tiny", "zooo": "x"}}]}, "orgs.0.model.zooo"),
        ({"orgs": [{"id": "a", "model": {"zoo": "t"}}, {"id": "b", "model": {"zoo": "t"}, "x": 1}]}, "orgs.1.x"),
    ],
)
def test_unknown_keys_fail_naming_the_dotted_field(data, field):
    msg = _error(data)
    assert f"{field}: Extra inputs are not permitted" in msg


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("trainer", "lr", -1),
        ("trainer", "epochs", 0),
        ("algorithm", "name", "foo"),
        ("algorithm", "cross_clip_delta", 1.5),
        ("generation", "engine", "tgi"),
        ("generation", "top_p", 0),
        ("federation", "transport", "carrier-pigeon"),
        ("federation", "min_orgs", 0),
        ("task", "eval_size", 0),
    ],
)
def test_bad_values_name_the_field(section, field, value):
    msg = _error(_minimal(**{section: {field: value}}))
    assert msg.startswith("invalid config: ")
    assert f"{section}.{field}:" in msg


def test_every_bad_field_is_reported_at_once():
    msg = _error(_minimal(trainer={"lr": -1}, algorithm={"name": "foo"}))
    assert "trainer.lr:" in msg and "algorithm.name:" in msg


def test_ratio_bounds_cross_check_names_the_section():
    msg = _error(_minimal(algorithm={"ratio_min": 5.0, "ratio_max": 2.0}))
    assert "algorithm:" in msg and "ratio_min must be <= ratio_max" in msg


@pytest.mark.parametrize("model", [{}, {"zoo": "tiny", "path": "/m"}, {"device": "cpu"}])
def test_model_needs_exactly_one_of_zoo_or_path(model):
    msg = _error({"orgs": [{"id": "a", "model": model}]})
    assert "orgs.0.model: set exactly one of 'zoo', 'real' or 'path'" in msg


def test_org_needs_a_model_and_a_valid_id():
    assert "orgs.0.model: Field required" in _error({"orgs": [{"id": "a"}]})
    assert "orgs.0.id:" in _error({"orgs": [{"id": "has space", "model": {"zoo": "t"}}]})
    assert "orgs.0.id:" in _error({"orgs": [{"id": "", "model": {"zoo": "t"}}]})


def test_duplicate_org_ids_are_rejected():
    org = {"id": "acme", "model": {"zoo": "tiny"}}
    msg = _error({"orgs": [org, {"id": "b", "model": {"zoo": "tiny"}}, dict(org)]})
    assert "duplicate org ids: ['acme']" in msg


def test_min_orgs_cannot_exceed_org_count():
    msg = _error(_minimal(federation={"min_orgs": 3}))
    assert "federation.min_orgs=3 exceeds the 2 orgs" in msg
    assert load_config(_minimal(federation={"min_orgs": 2})).federation.min_orgs == 2


# --- per-org overrides -------------------------------------------------------------------------------------


def test_org_overrides_merge_over_run_sections(tmp_path):
    cfg = load_config(_write(tmp_path, TWO_ORGS_YAML))
    acme, globex = org_trainer(cfg, "acme"), org_trainer(cfg, "globex")
    assert acme == cfg.trainer
    assert globex.lr == pytest.approx(5e-5)
    assert globex.lora.r == 16 and globex.epochs == cfg.trainer.epochs
    gen = org_generation(cfg, "globex")
    assert gen.temperature == pytest.approx(0.7)
    assert (gen.num_samples, gen.max_new_tokens) == (4, 16)
    assert org_generation(cfg, "acme") == cfg.generation
    assert cfg.trainer.lr == pytest.approx(1e-4)  # the run's own section is untouched


def test_nested_org_override_keeps_run_level_siblings():
    data = _minimal(trainer={"lora": {"r": 32, "alpha": 64.0}})
    data["orgs"][1]["trainer"] = {"lora": {"enabled": True}}
    lora = org_trainer(load_config(data), "b").lora
    assert (lora.enabled, lora.r, lora.alpha) == (True, 32, 64.0)


@pytest.mark.parametrize(
    ("section", "override", "field"),
    [
        ("trainer", {"lr": -1}, "orgs[b].trainer.lr:"),
        ("trainer", {"lrr": 1}, "orgs[b].trainer.lrr: Extra inputs"),
        ("trainer", {"lora": {"rank": 4}}, "orgs[b].trainer.lora.rank: Extra inputs"),
        ("generation", {"engine": "x"}, "orgs[b].generation.engine:"),
        ("generation", {"num_samples": 0}, "orgs[b].generation.num_samples:"),
    ],
)
def test_bad_org_override_names_the_org(section, override, field):
    data = _minimal()
    data["orgs"][1][section] = override
    msg = _error(data)
    assert msg.startswith("invalid config: ")
    assert field in msg
    assert msg.count("invalid config") == 1


def test_org_lookup_and_unknown_org():
    cfg = load_config(_minimal())
    assert cfg.org("b").id == "b"
    with pytest.raises(KeyError, match="no org 'zzz'"):
        cfg.org("zzz")
    with pytest.raises(KeyError):
        org_trainer(cfg, "zzz")


@pytest.mark.parametrize("override", ["trainer.lr=1e999", "trainer.lr=.nan", "federation.round_timeout_s=.inf",
                                      "security.max_mismatch_rate=.nan", "algorithm.alpha=-.inf"])
def test_non_finite_numbers_are_refused_naming_the_field(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].split(".")[-1]):
        load_config(_minimal(), overrides=[override])


@pytest.mark.parametrize("name", ["../escaped", "a/b", "..", "/abs", ""])
def test_run_name_cannot_leave_the_run_dir(name):
    with pytest.raises(ConfigError, match="name"):
        load_config({**_minimal(), "name": name})


def test_security_section_cross_checks():
    with pytest.raises(ConfigError, match="encrypt needs signing"):
        load_config({**_minimal(), "security": {"encrypt": True, "signing": False}})
    with pytest.raises(ConfigError, match="at most one of 'roster' and 'roster_file'"):
        load_config({**_minimal(), "security": {"roster": {"a": "x"}, "roster_file": "r.yaml"}})
    assert load_config(_minimal()).security.signing is True


# --- GPU recipes (configs/recipes/): loaded and checked against the paper, no model loaded ---------------------

RECIPES = Path(__file__).resolve().parent.parent / "configs" / "recipes"


@pytest.mark.parametrize("name,org_ids", [("qwen3-1.7b+qwen3-4b", ["qwen3-1.7b", "qwen3-4b"]),
                                          ("qwen3-4b+llama3.2-3b", ["qwen3-4b", "llama3.2-3b"])])
def test_paper_recipes_load_with_the_paper_hyper_parameters(name, org_ids):
    cfg = load_config(RECIPES / f"{name}.yaml")
    assert cfg.name == name and [o.id for o in cfg.orgs] == org_ids
    a = cfg.algorithm
    assert (a.name, a.alpha, a.cross_clip_delta, a.cross_clip_step, a.kl_beta) == ("hacpo", 1.0, 0.2, 0.025, 0.001)
    assert (a.self_clip_low, a.self_clip_high, a.capability_window, a.ratio_min, a.ratio_max) == (
        3e-4, 4e-4, 5, 0.1, 10.0)
    assert cfg.federation.prompts_per_round == 128 and cfg.federation.min_orgs == 2  # B
    for org in cfg.orgs:
        gen, trainer = org_generation(cfg, org.id), org_trainer(cfg, org.id)
        assert gen.num_samples == 8 and gen.engine == "vllm" and gen.dtype == "bfloat16"  # G
        assert (gen.temperature, gen.top_p, gen.top_k) == (1.0, 1.0, 0)
        assert gen.sleep_during_train and 0 < gen.gpu_memory_utilization <= 0.35
        assert gen.max_model_len >= gen.max_new_tokens
        assert trainer.minibatch_size == 64 * gen.num_samples  # mini-batch of 64 prompts
        # own + cross rows = 2 x B x G per learner -> 4 optimizer steps per round (the paper)
        assert 2 * cfg.federation.prompts_per_round * gen.num_samples // trainer.minibatch_size == 4
        assert trainer.precision == "bf16-master" and trainer.gradient_checkpointing and trainer.grad_clip == 1.0
        assert org.model.dtype == "bfloat16" and org.model.device == "cuda"
        assert org.model.path.startswith("/models/") and org.model.zoo is None  # a local folder the user fills in
    from hacrl_fed.tasks.jsonl_math import JsonlMathParams

    params = JsonlMathParams.model_validate(cfg.task.params)  # valid task params (the files are the user's)
    assert cfg.task.name == "jsonl" and params.path.endswith(".jsonl") and params.answer_format == "boxed"
    assert (params.question_field, params.answer_field) == ("problem", "solution")  # MATH's JSONL fields


# --- field descriptions and `hacrl-fed config` --------------------------------------------------------------------


def test_every_config_field_has_a_description():
    from hacrl_fed.config_describe import iter_fields

    names = [name for name, _, _ in iter_fields()]
    assert {"algorithm.logprob_norm", "trainer.lora.dropout", "orgs[].model.zoo", "security.roster"} <= set(
        names)
    missing = [name for name, info, _ in iter_fields() if not (info.description or "").strip()]
    assert not missing, f"config fields without a description: {missing}"
    for model in (AlgorithmConfig, TrainerConfig, GenerationConfig, RunConfig):  # every section too
        assert (model.__doc__ or "").strip()


def test_config_describe_lists_every_field_with_type_default_and_description(capsys):
    from hacrl_fed.cli import main
    from hacrl_fed.config_describe import iter_fields

    assert main(["config", "--describe"]) == 0
    out = capsys.readouterr().out
    for name, info, is_section in iter_fields():
        assert (f"{name}:" if is_section else f"{name}  (") in out, name
        assert " ".join(info.description.split()[:4]) in " ".join(out.split()), name
    assert "algorithm.logprob_norm  (per_token | per_byte)  default per_byte" in out
    assert "trainer.lr  (float, > 0)  default 2e-05" in out


def test_config_describe_with_a_file_shows_resolved_values(tmp_path, capsys):
    from hacrl_fed.cli import main

    path = _write(tmp_path, TWO_ORGS_YAML)
    assert main(["config", "--describe", "--config", str(path), "--set", "trainer.epochs=2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("trainer.epochs  ("))
    assert lines[at + 1].strip() == "= 2*"  # * marks a value other than the default
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("trainer.lr  ("))
    assert lines[at + 1].strip() == "= 0.0001*" and lines[at + 2].strip() == "per org: acme: 0.0001, globex: 5e-05"
    assert "= acme: tiny-a, globex: null" in out  # orgs[].model.zoo
    assert main(["config", "--config", str(path)]) == 0  # the resolved config as YAML
    assert yaml.safe_load(capsys.readouterr().out)["orgs"][1]["trainer"] == {"lr": 5e-05}


def test_config_command_bad_config_is_one_line_and_exit_2(tmp_path, capsys):
    from hacrl_fed.cli import main

    path = _write(tmp_path, TWO_ORGS_YAML)
    assert main(["config", "--describe", "--config", str(path), "--set", "trainer.lr=-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hacrl-fed config: error: invalid config: trainer.lr: Input should be greater than 0")
    assert len(err.splitlines()) == 1
    log_path = Path(err.rsplit("(traceback in ", 1)[1].rstrip(")"))
    assert "ConfigError" in log_path.read_text()
    log_path.unlink()


# --- the run config's size (issue 42) ------------------------------------------------------------------------------

MAX_RUN_CONFIG_FIELDS = 125  # issue 42: every field used by a default path, the paper's form or a measured win


def test_the_run_config_has_at_most_125_fields(capsys):
    """The count `hacrl-fed config --describe` shows: every leaf field of the run config, found by recursing through
    the pydantic models' ``model_fields`` (a section, e.g. ``trainer.lora``, is not a field; each org's fields count
    once, as ``orgs[].model.zoo``; a free-form mapping such as ``task.params`` or ``orgs[].trainer`` counts as one)."""
    from hacrl_fed.cli import main
    from hacrl_fed.config_describe import iter_fields

    leaves = [name for name, _, is_section in iter_fields() if not is_section]
    assert len(leaves) == len(set(leaves)) and "orgs[].sharding.ranks" in leaves and "trainer.lora" not in leaves
    assert main(["config", "--describe"]) == 0
    described = [line for line in capsys.readouterr().out.splitlines() if line.strip().split("  (")[0] in leaves]
    assert len(described) == len(leaves)  # one line per field: the count the describe command shows
    assert len(leaves) <= MAX_RUN_CONFIG_FIELDS, f"{len(leaves)} run config fields (at most {MAX_RUN_CONFIG_FIELDS})"


def _removed_fields() -> list[tuple[str, str]]:
    """``(dotted section, field)`` of every field a section lists as removed (``removed_fields``)."""
    from hacrl_fed.config_describe import _section_model, iter_fields

    out = [("", name) for name in RunConfig.removed_fields]
    for dotted, info, is_section in iter_fields():
        model = _section_model(info) if is_section else None
        if model is not None:
            prefix = f"{dotted}[]" if dotted == "orgs" else dotted
            out += [(prefix, name) for name in model.removed_fields]
    return out


def test_removed_fields_are_listed():
    assert {("algorithm", "adv_eps"), ("trainer", "forward"), ("samples", "own_per_round"),
            ("orgs[].model", "cache_dir")} <= set(_removed_fields())  # fmt: skip


@pytest.mark.parametrize(("section", "field"), _removed_fields())
def test_a_removed_field_fails_with_one_line_naming_it(section, field):
    data = _minimal()
    node: dict[str, Any] = data["orgs"][1] if section.startswith("orgs[]") else data
    for part in section.removeprefix("orgs[]").strip(".").split("."):
        if part:
            node = node.setdefault(part, {})
    node[field] = node.get(field, 1)
    msg = _error(data)
    where = section.replace("orgs[]", "orgs.1")
    assert f"{where}: {field} was removed from the run config (issue 42): " in msg and "\n" not in msg
    if section == "trainer":  # an org's trainer overrides too
        msg = _error({"orgs": [{"id": "a", "model": {"zoo": "tiny"}, "trainer": {field: 1}}]})
        assert f"{field} was removed from the run config (issue 42)" in msg and "orgs[a].trainer" in msg


def test_report_error_keeps_the_traceback_in_the_run_dir_or_a_temp_file(tmp_path, capsys):
    from hacrl_fed.config import BuildError, report_error

    try:
        raise BuildError("model.path='/nope': no such file or directory")
    except BuildError as err:
        assert report_error("hacrl-fed worker", err, log_dir=tmp_path) == 2
        assert report_error("hacrl-fed worker", err, log_dir=tmp_path / "missing") == 2
    first, second = capsys.readouterr().err.strip().splitlines()
    assert first == (f"hacrl-fed worker: error: model.path='/nope': no such file or directory (traceback in "
                     f"{tmp_path / 'error.log'})")
    assert "Traceback" in (tmp_path / "error.log").read_text()
    temp = Path(second.rsplit("(traceback in ", 1)[1].rstrip(")"))
    assert temp.name.startswith("hacrl-fed-worker-error-") and "BuildError" in temp.read_text()
    temp.unlink()
    assert issubclass(BuildError, ConfigError) and issubclass(BuildError, ValueError)


def test_config_hash_without_defaults_sees_only_fields_set_away_from_them():
    from hacrl_fed.config import config_hash, load_config

    base = load_config("configs/smoke.yaml")
    same = load_config("configs/smoke.yaml", ["trainer.gradient_checkpointing=false"])  # the default, set explicitly
    other = load_config("configs/smoke.yaml", ["trainer.gradient_checkpointing=true"])
    assert config_hash(base, exclude_defaults=True) == config_hash(same, exclude_defaults=True)
    assert config_hash(base, exclude_defaults=True) != config_hash(other, exclude_defaults=True)
    assert config_hash(base) != config_hash(base, exclude_defaults=True)  # the full dump is another digest
