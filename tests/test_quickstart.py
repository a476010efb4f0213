"""README's quick start: six changed lines turn a plain Ray Train script into raycomp's, the
README shows those lines as the script has them. The script's run, as a user runs it with
the installed wheel outside the repository: tests/test_wheel.py."""

from __future__ import annotations

import ast
import re

from tests.support.repo import REPO

SCRIPT = REPO / "examples" / "quickstart.py"
MARK = re.compile(r"^(?P<indent>\s*)(?P<code>.*?)\s*# raycomp: (?P<note>.*)$")


def _marked() -> list[tuple[int, str, str, str]]:
    """(line index, indent, code, note) of each line marked ``# raycomp:``."""
    lines = SCRIPT.read_text().splitlines()
    return [(i, m["indent"], m["code"], m["note"]) for i, line in enumerate(lines) if (m := MARK.match(line))]


def _plain() -> str:
    """The script with raycomp's lines undone: an added line dropped, a changed one restored."""
    lines = SCRIPT.read_text().splitlines()
    for i, indent, _, note in reversed(_marked()):
        if note == "added":
            del lines[i]
        else:
            assert note.startswith("was "), note
            lines[i] = indent + note[len("was "):]
    return "\n".join(lines) + "\n"


def test_six_lines_separate_the_quick_start_from_a_plain_ray_train_script():
    marked = _marked()
    assert len(marked) <= 6, [code for _, _, code, _ in marked]
    plain = _plain()
    ast.parse(plain)  # still a script
    assert "raycomp" not in plain.replace("raycomp-runs", "").split('"""', 2)[2], "an unmarked raycomp line"
    # the plain script is Ray Train's usual one: Ray prepares the model, the optimizer steps,
    # Ray's report; the quick start reports through raycomp's, as the docs say to
    assert "ray.train.torch.prepare_model(model)" in plain and "optimizer.step()" in plain
    assert "ray.train.report(" in plain
    script = SCRIPT.read_text()
    assert "raycomp.train.report(" in script and "ray.train.report(" not in script.replace("# raycomp: was ray.train", "")


def test_the_readme_shows_the_quick_start_lines_as_the_script_has_them():
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Quick start: your Ray Train script", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    shown = {re.sub(r"\s+", " ", line.split("#")[0]).strip() for line in block.splitlines()}
    for _, _, code, _ in _marked():
        if code.startswith("run_config ="):  # shown as TorchTrainer's argument in README
            code = "callbacks=[raycomp.train.ControllerCallback()])).fit()"
        assert re.sub(r"\s+", " ", code).strip() in shown, code
