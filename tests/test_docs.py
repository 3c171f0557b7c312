"""The README and the guides in docs/ hold together: every relative link reaches a file of the
repository (and a heading, when it names one), no link leaves the repository, and every
`./workbench <subcommand>` they show is one the workbench knows."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "desktop_sandbox").glob("*.md"))]

# The `workbench` script's own cases; anything else goes to `python -m arpo_lib` (arpo_lib/cli.py).
WORKBENCH_CASES = {"help", "-h", "--help", "setup", "setup-vllm", "setup-osworld", "setup-desktop", "smoke", "test",
                   "reliability"}

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def _ids(name: str) -> str:
    return name.replace(str(ROOT) + "/", "")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _links(path: Path) -> list[str]:
    return LINK.findall(_prose(path.read_text(encoding="utf-8")))


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped except
    hyphens and underscores, spaces to hyphens, repeats numbered (-1, -2, ...)."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    anchors = set()
    for _, title in HEADING.findall(text):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: _ids(str(p)))
def test_every_relative_link_resolves_inside_the_repository(doc: Path) -> None:
    bad = []
    for target in _links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            bad.append(f"{target}: leaves the repository (a URL)")
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.is_relative_to(ROOT) or "shared/" in file_part:
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {_ids(str(dest))}")
    assert not bad, f"{_ids(str(doc))}:\n" + "\n".join(bad)


def _cli_subcommands() -> set[str]:
    """The subcommands of `python -m arpo_lib`, read from the parser `arpo_lib.cli.main` builds."""
    from arpo_lib import cli

    class Built(Exception):
        pass

    def capture(self, *args, **kwargs):
        raise Built(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        cli.main([])
    except Built as built:
        parser = built.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    return {name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name in action.choices}


def _workbench_commands(doc: Path) -> list[str]:
    """The first word after `./workbench` in the file's code: fenced blocks and inline spans."""
    text = doc.read_text(encoding="utf-8")
    code = [m.group(0) for m in FENCE.finditer(text)] + [m.group(0) for m in INLINE_CODE.finditer(FENCE.sub("", text))]
    return [m.group(1) for block in code for m in re.finditer(r"\./workbench[ \t]+([^\s`'\"|;&)]+)", block)]


def test_the_cli_subcommands_are_read():
    assert {"train", "eval", "notebook", "compare"} <= _cli_subcommands()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: _ids(str(p)))
def test_every_workbench_command_shown_exists(doc: Path) -> None:
    known = WORKBENCH_CASES | _cli_subcommands()
    placeholder = re.compile(r"^(\.\.\.|…|<.*|\[.*)$")  # `./workbench ...`, `./workbench <args>`
    unknown = sorted({cmd for cmd in _workbench_commands(doc) if cmd not in known and not placeholder.match(cmd)})
    assert not unknown, f"{_ids(str(doc))} shows ./workbench subcommands that do not exist: {unknown}"


def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = readme.splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines: manuals belong in docs/"
    first_screen = "\n".join(lines[:60])
    assert "./workbench smoke" in first_screen and "./workbench test" in first_screen
    assert "docs/" in first_screen, "the guides are linked from the first screen"


# What the repository says speaks of the project itself: no reference a reader cannot resolve to
# how the work on it was organised (numbered tickets and checkpoints of the people who built it,
# the machines they were lent for a while). Public trackers are written with a hash (ARPO's GitHub
# issue #13, xlang-ai/OSWorld #154) and stay; so do the desktop's own sessions (GNOME, X, D-Bus's
# session bus) and torch taken from another environment (scripts/setup_osworld.sh). The patterns
# spell their spaces as \s+ so that they do not find themselves here.
INTERNAL_VOCABULARY = re.compile("|".join(f"(?:{p})" for p in (
    r"\b(?:issue|stop)s?(?:\s+|[_-])\d+",                      # a ticket or a checkpoint by number
    r"\b(?:the|this|that|GPU)\s+issue'?s?\b(?!\s*#)",          # a ticket by description
    r"\bsessions?'?s?\s+(?:machine|host)s?\b",                  # whose turn ran on which machine
    r"\b(?:this|that|the\s+next|a\s+later|the\s+previous)\s+session\b(?![\s-]*bus)",
    r"\bfresh\s+start\s+of\s+the\s+session\b",
    r"\b(?:GPU|device|helper)\s+sessions?\b",
    r"\b(?:lent|borrowed)\s+(?:(?:a|an|the|one|our)\s+)?(?:GPU|device|machine|accelerator|H[12]00)s?\b",
    r"\bdevice\s+tool\b",
    r"\bthe\s+workplace\b",
    r"`run`\s+tool\b",
    r"\bour\s+CI\b|\bCI\s+machines?\s+of\s+ours\b",           # whose CI
)), re.I)
VOCABULARY_WORDS = re.compile(r"issue|stop|session|lent|borrowed|device|workplace|`run`|our\s+ci|ci\s+machine")
"""A word every pattern above needs, in lower case: only lines with one are matched (fast)."""
VOCABULARY_TREES = ("arpo_lib", "desktop_sandbox", "benchmarks", "scripts", "tests")
SKIPPED_DIRS = {".venv", "venv", "__pycache__", ".ipynb_checkpoints", "node_modules", ".pytest_cache"}


def _speaking_files() -> list[Path]:
    """What a reader of the repository reads: the README, the guides (and the reports generated
    into docs/), the configs, the notebooks (sources and committed outputs alike), the workbench
    script, and the sources, scripts and tests."""
    files = [ROOT / "README.md", ROOT / "workbench", *(ROOT / "docs").rglob("*.md"),
             *(ROOT / "configs").glob("*.yaml"), *(ROOT / "notebooks").glob("*.ipynb")]
    for tree in VOCABULARY_TREES:
        for pattern in ("*.py", "*.sh", "*.md"):
            files += [p for p in (ROOT / tree).rglob(pattern)
                      if not SKIPPED_DIRS.intersection(p.relative_to(ROOT).parts)]
    return sorted({p for p in files if p.is_file()})


def test_the_repository_speaks_of_the_project_not_of_how_it_was_built() -> None:
    files = _speaking_files()
    assert len(files) > 100, f"only {len(files)} files found to read: the scan would pass vacuously"
    assert {"README.md", "docs/learning.md", "tests/test_docs.py"} <= {_ids(str(p)) for p in files}
    hits = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if not VOCABULARY_WORDS.search(text.lower()):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if VOCABULARY_WORDS.search(line.lower()) and (m := INTERNAL_VOCABULARY.search(line)):
                hits.append(f"{_ids(str(path))}:{number}: {m.group(0)!r} in {line.strip()[:160]}")
    assert not hits, ("name things by what they are, not by the tickets, checkpoints or machines of "
                      f"the people who built them ({len(hits)} lines):\n" + "\n".join(hits))
