"""The layering rules, checked on the source with ``ast``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "filechannel"
MODULES = sorted(PKG.rglob("*.py"))  # the subpackages (agent, spark, testing) too
PURE = ("format.py", "_queue.py", "_runs.py", "_readindex.py", "agent/syslog_wire.py")
BANNED_IMPORTS = {"os", "io", "time", "logging"}
DURABILITY_CALLS = {
    ("os", "fsync"),
    ("os", "fdatasync"),
    ("os", "replace"),
    ("os", "rename"),
    ("os", "unlink"),
    ("os", "remove"),
    ("os", "ftruncate"),
    ("os", "truncate"),
    ("os", "pwrite"),
    ("os", "write"),
    ("fcntl", "flock"),
    ("fcntl", "lockf"),
}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_there_are_modules() -> None:
    names = {p.name for p in MODULES}
    assert {"format.py", "_fs.py", "log.py", "_queue.py", "channel.py", "cli.py"} <= names


@pytest.mark.parametrize("name", PURE)
def test_pure_modules_do_no_io(name: str) -> None:
    tree = _tree(PKG / name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                assert a.name.split(".")[0] not in BANNED_IMPORTS, f"{name} imports {a.name}"
        elif isinstance(node, ast.ImportFrom):
            mod = (node.module or "").split(".")[0]
            assert node.level > 0 or mod not in BANNED_IMPORTS, f"{name} imports from {node.module}"
            assert not (node.level > 0 and node.module == "_fs"), f"{name} imports the I/O seam"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id != "open", f"{name} calls open() at line {node.lineno}"


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "_fs.py"], ids=lambda p: p.name)
def test_only_fs_makes_durability_calls(path: Path) -> None:
    tree = _tree(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            assert (node.value.id, node.attr) not in DURABILITY_CALLS, (
                f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}; go through filechannel._fs"
            )
        if isinstance(node, ast.ImportFrom) and node.module in ("os", "fcntl"):
            for a in node.names:
                assert (node.module, a.name) not in DURABILITY_CALLS, f"{path.name} imports {node.module}.{a.name}"
        if isinstance(node, ast.Import):
            assert all(a.name != "fcntl" for a in node.names), f"{path.name} imports fcntl"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """The filechannel modules ``path`` imports: lazily inside functions too, and for type hints only."""
    tree = _tree(path)
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    skip: set[int] = set()
    known = {_module_name(p) for p in MODULES}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("filechannel"):
                out.add(t)
    return out


def test_imports_point_down_no_circles() -> None:
    """No two modules import each other, directly or round a longer loop (lazy and type-only imports count too).

    A package's ``__init__`` is left out: it only re-exports what lies below it.
    """
    graph = {_module_name(p): _imports(p) for p in MODULES if p.name != "__init__.py"}
    graph = {m: {t for t in deps if t in graph} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                loop = [*stack[stack.index(t) :], t]
                raise AssertionError("an import circle: " + " -> ".join(loop))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_circle_check_sees_a_circle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "filechannel"
    pkg.mkdir()
    (pkg / "a.py").write_text('"""A."""\n\ndef f():\n    from . import b\n')
    (pkg / "b.py").write_text('"""B."""\nfrom .a import f\n')
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", sorted(pkg.rglob("*.py")))
    with pytest.raises(AssertionError, match=r"an import circle: filechannel\.a -> filechannel\.b -> filechannel\.a"):
        test_imports_point_down_no_circles()


def test_the_checker_catches_a_violation(tmp_path: Path) -> None:
    """The rule above is not vacuous: it sees ``os.fsync`` in a module."""
    bad = tmp_path / "bad.py"
    bad.write_text('"""Doc."""\nimport os\n\n\ndef f(fd):\n    os.fsync(fd)\n')
    with pytest.raises(AssertionError, match=r"os\.fsync"):
        test_only_fs_makes_durability_calls(bad)


def _private_members(tree: ast.Module) -> set[str]:
    """The private names (``_x``, not dunders) a module's classes define: methods, ``self._x`` and class attributes."""
    out: set[str] = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.add(node.name)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                out.add(node.attr)
        for node in cls.body:
            if isinstance(node, ast.Assign):
                out.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
    return {m for m in out if m.startswith("_") and not m.startswith("__")}


def _reach_ins(modules: list[Path]) -> list[str]:
    """Uses of a private member that only classes of *other* modules define (``obj._x``, or ``self._x`` inherited).

    A name some class of the using module defines too is taken as its own (the check cannot tell
    the two apart without types): it finds the side doors, not every one.
    """
    trees = {p: _tree(p) for p in modules}
    own = {p: _private_members(t) for p, t in trees.items()}
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if node.attr in own[path]:
                continue
            owners = sorted(q.name for q in trees if q != path and node.attr in own[q])
            if owners:
                found.append(f"{path.name}:{node.lineno} uses {ast.unparse(node)}, private to {', '.join(owners)}")
    return found


def test_no_module_reaches_into_another_modules_private_members() -> None:
    """A module uses another's classes through their public names: no ``tx._put_column``, no base-class privates."""
    found = _reach_ins(MODULES)
    assert not found, "give these a public name:\n" + "\n".join(found)


def test_the_reach_in_check_sees_a_side_door(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text('"""A."""\n\n\nclass A:\n    def _secret(self):\n        return 1\n')
    (tmp_path / "b.py").write_text('"""B."""\n\n\ndef f(a):\n    return a._secret()\n')
    (tmp_path / "c.py").write_text('"""C."""\n\n\nclass C:\n    def _secret(self):\n        return self._secret()\n')
    found = _reach_ins(sorted(tmp_path.glob("*.py")))
    assert len(found) == 1, found
    assert found[0] == "b.py:5 uses a._secret, private to a.py, c.py", found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_every_module_has_a_docstring(path: Path) -> None:
    doc = ast.get_docstring(_tree(path)) or ""
    assert doc.strip(), f"{path.name} has no module docstring"


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "cli.py"], ids=lambda p: p.name)
def test_print_only_in_cli(path: Path) -> None:
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id != "print", f"{path.name}:{node.lineno} prints; log instead"


def test_import_does_not_load_optional_dependencies() -> None:
    code = (
        "import sys, filechannel\n"
        "opt = ('pyspark', 'cryptography', 'pyarrow', 'aiohttp', 'prometheus_client', 'msgpack', 'google')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in opt)\n"
        "print(','.join(bad))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""


def test_filechannel_spark_without_pyspark_says_what_to_install() -> None:
    """``filechannel.spark.register`` with PySpark missing: an ImportError naming the extra; the core still imports."""
    code = (
        "import sys\n"
        "class Missing:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'pyspark':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n"
        "import filechannel\n"
        "import filechannel.spark\n"
        "try:\n"
        "    filechannel.spark.register\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "pip install '.[spark]' in filechannel's clone" in r.stdout


def test_encryption_without_cryptography_says_what_to_install() -> None:
    """``filechannel.Encryption`` with ``cryptography`` missing: a ConfigError naming the extra."""
    code = (
        "import sys\n"
        "class Missing:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'cryptography':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n"
        "import filechannel\n"
        "try:\n"
        "    filechannel.Encryption(keys={'k': bytes(32)})\n"
        "except filechannel.ConfigError as exc:\n"
        "    print(exc)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "pip install '.[crypto]' in filechannel's clone" in r.stdout


def _closure(start: str) -> set[str]:
    """Every filechannel module ``start`` loads, directly or through others (its packages' ``__init__`` aside)."""
    graph = {_module_name(p): _imports(p) for p in MODULES if p.name != "__init__.py"}
    seen: set[str] = set()
    todo = [start]
    while todo:
        m = todo.pop()
        for t in graph.get(m, ()):
            if t in graph and t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def test_event_stands_below_the_write_stack() -> None:
    """``Event`` is reached without the channel, the log or the writer: the read side does not stand on them."""
    write_stack = {"filechannel.channel", "filechannel.log", "filechannel.writer"}
    assert not _closure("filechannel.events") & write_stack
    assert "filechannel.channel" not in _closure("filechannel.reader")
    assert "filechannel.channel" not in _closure("filechannel.agent.client")
