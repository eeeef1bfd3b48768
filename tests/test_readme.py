"""The README cannot rot: its quickstart is two commands, and every Python block runs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

README = (Path(__file__).parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_quickstart_is_two_commands_at_the_top():
    first_block = re.search(r"```(\w*)\n(.*?)```", README, re.S)
    assert first_block.group(1) == "sh"
    lines = [line for line in first_block.group(2).splitlines() if line.strip()]
    assert len(lines) == 2
    assert "pip install ." in lines[0] and " -e " not in lines[0] and lines[0].endswith("ember demo")  # what users get
    assert "pip install -e '.[test" in lines[1] and "pytest" in lines[1]
    assert README.index(first_block.group(0)) < README.index("## ")


def _matches(printed: str, stated: str) -> bool:
    """``stated`` is the README's comment after a print: the output with whitespace collapsed, ``…``
    standing for any text, and an optional explanation after `` — ``."""
    output = " ".join(stated.split(" — ")[0].split())
    pattern = ".*".join(re.escape(part) for part in output.split("…"))
    return re.fullmatch(pattern, " ".join(printed.split()), re.S) is not None


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_prints_what_the_readme_states(index):
    """Each block runs, and every ``print(...)  # output`` line prints the output its comment states."""
    source = BLOCKS[index]
    if "import ray" in source:  # the Ray block: ember[ray], which the test extra installs
        pytest.importorskip("ray")
    if "import torch" in source:  # ember.torch: the torch extra, which the quickstart's test command installs
        pytest.importorskip("torch")
    if '"jax:' in source:  # a jax device: the test extra installs jax where it runs (Python 3.11 and newer)
        pytest.importorskip("jax")
    filename = f"README.md block {index}"
    stated = {number: line.split("# ", 1)[1] for number, line in enumerate(source.splitlines(), 1)
              if line.lstrip().startswith("print(")}
    checked = []

    def checking_print(*values, sep=" ", end="\n"):
        frame = sys._getframe(1)
        assert frame.f_code.co_filename == filename, "a README print is called from outside its block"
        printed = sep.join(map(str, values))
        expected = stated[frame.f_lineno]
        assert _matches(printed, expected), f"{filename}, line {frame.f_lineno}: printed {printed!r}, README states {expected!r}"
        checked.append(frame.f_lineno)

    exec(compile(source, filename, "exec"), {"__name__": f"readme_{index}", "print": checking_print})
    assert sorted(set(checked)) == sorted(stated), "a print line of the README did not run"


def test_output_matching_is_strict():
    assert _matches("[[1.1   1.273]\n [1.273 1.762]]", "[[1.1 1.273] [1.273 1.762]] — the one round trip")
    assert _matches("(2, 2) ember://127.0.0.1:4242/0", "(2, 2) ember://127.0.0.1:…/0")
    assert not _matches("(2, 3) ember://127.0.0.1:4242/0", "(2, 2) ember://127.0.0.1:…/0")
    assert not _matches("1.0 extra", "1.0") and not _matches("1", "1.0")


def test_readme_and_help_agree_on_the_demo_duration():
    from ember.cli import parser
    demo_help = next(a.help for a in parser()._subparsers._group_actions[0]._choices_actions if a.dest == "demo")
    duration = re.search(r"\((.*?)\)", demo_help).group(1)
    assert f"`ember demo` ({duration}" in README
