"""The configuration reference is generated from the typed configuration and cannot drift:
docs/configuration.md is the generator's output, every field of every reachable model is
in it with a meaning, and the example YAML that ``raycomp config`` prints is a valid config
at exactly the defaults."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import yaml
from pydantic import BaseModel

from jobs.config import load_config, validate
from raycomp import cli
from raycomp.config import (
    CheckpointSection,
    CompressionSection,
    ControllerSection,
    reference,
    section_docs,
)
from raycomp.config.base import CompressorConfig, Strict
from raycomp.config.policy_options import POLICY_OPTIONS
from tests.support.repo import REPO

DOC = REPO / "docs" / "configuration.md"


def test_docs_configuration_md_is_the_generators_output():
    assert DOC.read_text(encoding="utf-8") == reference.markdown(), (
        f"docs/configuration.md is stale: regenerate it with `{reference.REGENERATE}` "
        "(or `python -m raycomp.cli config --markdown > docs/configuration.md`)")


def _reachable(model: type[BaseModel], seen: set[type[BaseModel]]) -> set[type[BaseModel]]:
    """Every model a config model holds, found from its annotations alone (not through the
    generator), plus the policy sections ``compression`` holds besides its fields."""
    if model in seen or issubclass(model, CompressorConfig):
        return seen
    seen.add(model)
    stack: list[Any] = [info.annotation for info in model.model_fields.values()]
    while stack:
        tp = stack.pop()
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            _reachable(tp, seen)
        stack += typing.get_args(tp)
    if model is CompressionSection:
        for options in POLICY_OPTIONS.values():
            _reachable(options, seen)
    return seen


def test_every_field_of_every_reachable_model_is_documented_in_its_section():
    docs = reference.sections()
    models: set[type[BaseModel]] = set()
    for top in (CompressionSection, ControllerSection, CheckpointSection):
        _reachable(top, models)
    assert {s.model for s in docs} == models  # no section left out, none twice
    assert len(docs) == len(models)
    text = reference.markdown()
    for section in docs:
        assert [f.name for f in section.fields] == list(section.model.model_fields), section.key
        undocumented = [f.name for f in section.fields if not f.doc.strip()]
        assert not undocumented, (f"{section.key}: {undocumented} have no meaning: document each "
                                  "with a `#:` comment right above it")
        assert section.doc, f"{section.key}: its class has no docstring"
        block = text.split(f"# `{section.key}`\n", 1)[1].split("\n#", 1)[0]
        for f in section.fields:
            assert f"- **`{f.name}`**" in block, f"{section.key}.{f.name} is not in its section"


def test_every_train_option_is_documented():
    from raycomp.train.options import TrainOptions

    options = reference.train_options()
    assert [f.name for f in options.fields] == [f.name for f in dataclasses.fields(TrainOptions)]
    assert all(f.doc.strip() for f in options.fields), [f.name for f in options.fields if not f.doc]
    for f in dataclasses.fields(TrainOptions):
        assert f"- **`{f.name}`**" in reference.markdown()


def test_a_field_without_a_comment_is_found_and_comments_are_read_from_the_declaring_class():
    class Base(Strict):
        #: the first
        #: of two lines
        a: int = 1
        b: int = 2  # a trailing comment is not a meaning

    class Child(Base):
        #: overrides nothing of a, adds c
        c: str = "x"

    assert section_docs.field_comments(Child) == {"a": "the first of two lines", "c": "overrides nothing of a, adds c"}
    [section] = reference.sections((("demo", Child),))
    assert [(f.name, f.doc, f.default) for f in section.fields] == [
        ("a", "the first of two lines", 1), ("b", "", 2), ("c", "overrides nothing of a, adds c", "x")]


def _keys(data: Any, prefix: str = "") -> set[str]:
    if not isinstance(data, dict):
        return set()
    return {f"{prefix}{k}" for k in data} | {key for k, v in data.items() for key in _keys(v, f"{prefix}{k}.")}


def test_the_example_yaml_is_a_valid_job_config_at_exactly_the_defaults(tmp_path, capsys):
    assert cli.main(["config"]) == 0
    printed = capsys.readouterr().out
    assert printed == reference.example_yaml()
    data = yaml.safe_load(printed)
    assert set(data) == {"compression", "controller", "checkpoint"}
    for key, model in reference.TOP_SECTIONS:
        assert model.model_validate(data[key]) == model(), key
        assert data[key] == model().model_dump(mode="json"), key  # every field, none extra
    path = tmp_path / "defaults.yaml"
    path.write_text(printed, encoding="utf-8")
    assert load_config(str(path)).compression == CompressionSection()
    assert validate(data).controller == ControllerSection()
    # every field of every section is a key of the YAML, each under a comment of its meaning
    expected = {f"{s.key}.{f.name}" for s in reference.sections() if "[]" not in s.key for f in s.fields}
    assert expected <= _keys(data)
    lines = printed.splitlines()
    for i, line in enumerate(lines):
        if line.strip() and not line.lstrip().startswith("#") and i > 0:
            assert lines[i - 1].lstrip().startswith("# "), f"no meaning above {line.strip()!r}"


def test_raycomp_config_markdown_prints_the_reference(capsys):
    assert cli.main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == reference.markdown()


def test_docs_job_configuration_md_is_the_generators_output_and_covers_every_job_section():
    from jobs.config import JobConfig, job_reference

    assert (REPO / "docs" / "job-configuration.md").read_text(encoding="utf-8") == job_reference.markdown(), (
        f"docs/job-configuration.md is stale: regenerate it with `{job_reference.REGENERATE}`")
    assert [k for k, _ in job_reference.JOB_SECTIONS] == list(JobConfig.model_fields)
    for key, model in job_reference.JOB_SECTIONS:
        assert JobConfig.model_fields[key].annotation is model, key
    for section in reference.sections(job_reference.OWN_SECTIONS):
        assert section.doc and all(f.doc.strip() for f in section.fields), \
            (section.key, [f.name for f in section.fields if not f.doc.strip()])


def test_the_job_example_yaml_is_a_whole_job_config_at_exactly_the_defaults(capsys):
    from jobs.config import JobConfig, job_reference

    assert job_reference.main([]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert validate(data) == JobConfig()
    assert data == JobConfig().model_dump(mode="json")
