"""Every `pipeplan ...` command shown in README.md, docs/*.md and examples/README.md runs, so a documented command
that fails fails the suite; and the documents' links lead somewhere.

The commands of one document run in order in one temporary directory (a later command may read what an earlier one
wrote), with `examples/` and `tests/` linked in so that `examples/user_model.py:build` resolves as it does from the
repository root. They run in this process through typer's CliRunner, with one torch thread (steadier on a busy
machine; no documented result depends on the thread count).

A command is left out only visibly: inside a ```console-no-test block, or with a `# not run by the doc test:
<reason>` comment on its line. Commands that start processes (`run`, `calibrate`, `profile --concurrent N`) run in
the `slow` test, with the commands whose files they read; the others, and whatever does not read a slow command's
files, in the quick one.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pipeplan.cli import app

ROOT = Path(__file__).resolve().parents[1]
NO_TEST_BLOCK = "console-no-test"  # a fenced block with this info string is shown, never run
NO_TEST_COMMENT = "# not run by the doc test:"  # the same for one command; a reason must follow
MULTI_PROCESS = ("run", "calibrate")  # commands that start processes: the slow test runs them
LINKED = ("examples", "tests")  # repository folders documented commands read, linked into each workspace
_FENCE = re.compile(r"^\s*```(\S*)\s*$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PIPEPLAN_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*=\S*\s+)*pipeplan(\s|$)")  # [VAR=value ...] pipeplan ...
_OUTPUT_FLAGS = ("-o", "--output", "--checkpoint-dir", "--trace")
_DEFAULT_OUTPUT = {"plan": "plan"}  # `pipeplan plan` writes ./plan without -o


@dataclass(frozen=True)
class DocCommand:
    document: str  # relative to the repository root
    line: int  # where the command starts (1-based)
    text: str  # as shown, continuation lines joined
    argv: tuple[str, ...]  # after `pipeplan`
    env: tuple[tuple[str, str], ...]  # leading VAR=value assignments

    @property
    def multi_process(self) -> bool:
        """`run`, `calibrate`, and a profile beside sibling processes (`--concurrent N`, N > 1)."""
        if not self.argv:
            return False
        concurrent = [value for flag, value in zip(self.argv, self.argv[1:]) if flag == "--concurrent"]
        return self.argv[0] in MULTI_PROCESS or any(value != "1" for value in concurrent)

    def writes(self) -> set[str]:
        """The paths it writes, as given on its command line."""
        found = {value for flag, value in zip(self.argv, self.argv[1:]) if flag in _OUTPUT_FLAGS}
        if self.argv[0] in _DEFAULT_OUTPUT and not {"-o", "--output"} & set(self.argv):
            found.add(_DEFAULT_OUTPUT[self.argv[0]])
        return {path.rstrip("/") for path in found}

    def reads(self, path: str) -> bool:
        return any(word == path or word.startswith((path + "/", path + ":")) for word in self.argv[1:])  # FILE:NAME

    def __str__(self) -> str:
        return f"{self.document}:{self.line}: {self.text}"


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]


def _logical_lines(block: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """A fenced block's lines with `\\` continuations joined, each with the number of its first line."""
    joined: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in block:
        start, text = pending if pending is not None else (number, "")
        text = f"{text} {line.strip()}" if text else line.strip()
        if text.endswith("\\"):
            pending = (start, text[:-1].rstrip())
        else:
            joined.append((start, text))
            pending = None
    if pending is not None:
        joined.append(pending)
    return joined


def _command(document: str, number: int, text: str) -> DocCommand | None:
    if not _PIPEPLAN_LINE.match(text):
        return None
    if NO_TEST_COMMENT in text:
        assert text.split(NO_TEST_COMMENT, 1)[1].strip(), f"{document}:{number}: an exclusion must give its reason"
        return None
    words = shlex.split(text, comments=True)
    env = []
    while words and _ASSIGNMENT.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        env.append((name, value))
    assert words[0] == "pipeplan", f"{document}:{number}: cannot read {text!r}"
    return DocCommand(document, number, text, tuple(words[1:]), tuple(env))


def fenced_blocks(path: Path) -> list[tuple[str, list[tuple[int, str]]]]:
    """(info string, [(line number, line)]) of each fenced code block."""
    blocks: list[tuple[str, list[tuple[int, str]]]] = []
    current: tuple[str, list[tuple[int, str]]] | None = None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fence = _FENCE.match(line)
        if fence and current is None:
            current = (fence.group(1), [])
        elif fence:
            blocks.append(current)
            current = None
        elif current is not None:
            current[1].append((number, line))
    assert current is None, f"{path}: a code block is not closed"
    return blocks


def extract(path: Path, root: Path = ROOT) -> list[DocCommand]:
    """The `pipeplan` commands in `path`'s fenced code blocks, in order; blocks tagged console-no-test are left
    out, and so is a command whose line says why it is not run."""
    document = str(path.relative_to(root))
    commands = []
    for info, block in fenced_blocks(path):
        if info != NO_TEST_BLOCK:
            found = (_command(document, number, text) for number, text in _logical_lines(block))
            commands.extend(c for c in found if c is not None)
    return commands


def split_slow(commands: list[DocCommand]) -> tuple[list[DocCommand], list[DocCommand]]:
    """(quick, slow): the slow list holds the multi-process commands, the commands reading files they wrote, and
    the earlier commands whose files those read; the quick list everything else. Both keep the document's order."""
    slow = [False] * len(commands)
    for i, command in enumerate(commands):  # forward: multi-process commands and what reads their files
        slow[i] = command.multi_process or any(
            slow[j] and any(command.reads(p) for p in commands[j].writes()) for j in range(i)
        )
    needed = list(slow)
    for i in reversed(range(len(commands))):  # backward: what the slow ones read
        if needed[i]:
            for j in range(i):
                if any(commands[i].reads(p) for p in commands[j].writes()):
                    needed[j] = True
    quick = [c for c, s in zip(commands, slow) if not s]
    return quick, [c for c, n in zip(commands, needed) if n]


def _invoke(command: DocCommand, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """Run one command in `cwd`; None when it succeeded, else what went wrong."""
    with monkeypatch.context() as env:
        env.chdir(cwd)
        for name, value in command.env:
            env.setenv(name, value)
        started = time.perf_counter()
        result = CliRunner().invoke(app, list(command.argv))
        seconds = time.perf_counter() - started
    print(f"{seconds:6.1f} s  {command}")
    if result.exit_code == 0:
        return None
    tail = "\n    ".join(result.output.strip().splitlines()[-6:])
    return f"{command}\n  exit {result.exit_code}:\n    {tail}"


def _run(commands: list[DocCommand], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        failures = [failure for c in commands if (failure := _invoke(c, tmp_path, monkeypatch)) is not None]
    finally:
        torch.set_num_threads(threads)
    assert not failures, "documented commands failed:\n" + "\n".join(failures)


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


QUICK = [p for p in documents() if split_slow(extract(p))[0]]
SLOW = [p for p in documents() if split_slow(extract(p))[1]]


@pytest.mark.parametrize("path", QUICK, ids=_ids(QUICK))
def test_documented_commands_run(path, tmp_path, monkeypatch):
    _run(split_slow(extract(path))[0], tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("path", SLOW, ids=_ids(SLOW))
def test_documented_multi_process_commands_run(path, tmp_path, monkeypatch):
    _run(split_slow(extract(path))[1], tmp_path, monkeypatch)


def test_the_walk_through_covers_the_pipeline():
    """examples/README.md goes profile -> plan -> show -> export -> run -> capacity."""
    shown = [c.argv[0] for c in extract(ROOT / "examples" / "README.md")]
    steps = ("profile", "plan", "show", "export", "run", "capacity")
    missing = [step for step in steps if step not in shown]
    assert not missing, f"examples/README.md shows no `pipeplan {missing[0]}` command"
    assert [shown.index(step) for step in steps] == sorted(shown.index(step) for step in steps)


def test_the_docs_name_every_room():
    """docs/README.md lists every subpackage of pipeplan (ARCHITECTURE.md has what each owns)."""
    text = (ROOT / "docs" / "README.md").read_text()
    rooms = [p.name for p in (ROOT / "pipeplan").iterdir() if (p / "__init__.py").exists()]
    assert rooms and not [room for room in rooms if f"`{room}/`" not in text]
    assert "ARCHITECTURE.md" in text


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    in_blocks = {number for _, block in fenced_blocks(path) for number, _ in block}
    lines = path.read_text().splitlines()
    return {_anchor(line.lstrip("#")) for n, line in enumerate(lines, 1) if line.startswith("#") and n not in in_blocks}


@pytest.mark.parametrize("path", documents(), ids=_ids(documents()))
def test_links_lead_somewhere(path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists() or anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: broken links {broken}"


def test_extract_joins_continuations_and_honours_exclusions(tmp_path):
    text = (
        "```bash\npipeplan plan gpt --devices 2 \\\n   -o plan   # a comment\n"
        "PIPEPLAN_DEBUG=1 pipeplan show plan/plan.json\n"
        "bash plan/launch.sh\n"
        "pipeplan run x  # not run by the doc test: needs CUDA\n```\n"
        "```console-no-test\npipeplan calibrate --device cuda\n```\n"
        "pipeplan models outside a block\n"
    )
    doc = tmp_path / "sample.md"
    doc.write_text(text)
    found = extract(doc, root=tmp_path)
    assert [c.argv for c in found] == [("plan", "gpt", "--devices", "2", "-o", "plan"), ("show", "plan/plan.json")]
    assert [c.line for c in found] == [2, 4]
    assert found[1].env == (("PIPEPLAN_DEBUG", "1"),)


def test_split_slow_keeps_what_multi_process_commands_need(tmp_path):
    doc = tmp_path / "sample.md"
    doc.write_text(
        "```bash\npipeplan profile gpt -o gpt.json\npipeplan plan gpt --profile gpt.json\n"
        "pipeplan plan gpt --profile gpt.json -o p\npipeplan capacity llama-7b --hardware h100 -n 8\n"
        "pipeplan run p/plan.json\npipeplan run plan/plan.json\n"
        "pipeplan calibrate --device cpu -o hw.json\npipeplan profile gpt --hardware-file hw.json --device meta\n"
        "pipeplan show p/plan.json\n```\n"
    )
    quick, slow = split_slow(extract(doc, root=tmp_path))
    assert [c.line for c in quick] == [2, 3, 4, 5, 10]
    assert [c.line for c in slow] == [2, 3, 4, 6, 7, 8, 9]  # not capacity; `plan` without -o writes ./plan
