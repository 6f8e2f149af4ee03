"""docs/testing.md executes: its test files run with pytester, as a user runs them, and fail as it shows.

A python block under ``<!-- test: file NAME -->`` is written as NAME; one under
``<!-- test: pytest[ spark], outcome passed=N failed=M -->`` is a user's test
file, run in a pytest subprocess (the plugin comes from the installed entry
point) with the expected outcomes. A plain block right after it is the output
it shows: each ``E`` line of it must appear (``...`` and times match anything).
The Spark example is run by tests/test_testing_stream.py (in-process, with
closer checks), not here: each stream_test costs two driver (JVM) starts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

DOC = (Path(__file__).resolve().parent.parent / "docs" / "testing.md").read_text(encoding="utf-8")
BLOCK = re.compile(r"<!-- test: (?P<spec>[^>]*?) -->\n```python\n(?P<code>.*?)```\n(?:\n```\n(?P<out>.*?)```)?", re.S)


def blocks() -> list[tuple[str, str, str | None]]:
    found = [(m["spec"], m["code"], m["out"]) for m in BLOCK.finditer(DOC)]
    assert len(found) == 4, "docs/testing.md: expected 4 marked blocks"
    return found


FILES = {spec.split()[1]: code for spec, code, _ in blocks() if spec.startswith("file ")}
TESTS = [(spec, code, out) for spec, code, out in blocks() if spec.startswith("pytest")]


def expected_lines(out: str) -> list[str]:
    """fnmatch patterns for the E lines a block shows (rows of the sink, listed in any order, are skipped)."""
    pats = []
    for line in out.splitlines():
        if not line.startswith("E ") or line[1:].strip() in ("", "...") or line[1:].strip().startswith("{"):
            continue
        text = re.sub(r"\(\d+\.\d s\)", "*", line[1:].strip()).replace("...", "*")
        pats.append("*" + text.replace("[", "[[]") + "*")
    return pats


def run_doc_test(pytester: pytest.Pytester, spec: str, code: str, out: str | None) -> None:
    outcome = dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", spec))
    pytester.makepyfile(**{name.removesuffix(".py"): text for name, text in FILES.items()})
    pytester.makepyfile(test_from_doc=code)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s")
    result.assert_outcomes(**outcome)
    if out:
        result.stdout.fnmatch_lines(expected_lines(out))


@pytest.mark.parametrize(("spec", "code", "out"), [t for t in TESTS if "spark" not in t[0]])
def test_doc_example_runs(pytester: pytest.Pytester, spec: str, code: str, out: str | None) -> None:
    run_doc_test(pytester, spec, code, out)


def test_the_doc_is_linked_from_the_readme() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    assert "docs/testing.md" in readme
