"""The README cannot rot: its quickstart is two commands, and every Python block runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = (Path(__file__).parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_quickstart_is_two_commands_at_the_top():
    first_block = re.search(r"```(\w*)\n(.*?)```", README, re.S)
    assert first_block.group(1) == "sh"
    lines = [line for line in first_block.group(2).splitlines() if line.strip()]
    assert len(lines) == 2
    assert "pip install" in lines[0] and "pip install" in lines[1] and "pytest" in lines[1]
    assert README.index(first_block.group(0)) < README.index("## ")


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_runs(index, capsys):
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {"__name__": f"readme_{index}"})


def test_readme_and_help_agree_on_the_demo_duration():
    from ember.cli import parser
    demo_help = next(a.help for a in parser()._subparsers._group_actions[0]._choices_actions if a.dest == "demo")
    duration = re.search(r"\((.*?)\)", demo_help).group(1)
    assert f"`ember demo` ({duration}" in README
