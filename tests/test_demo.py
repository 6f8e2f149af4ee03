"""The main job: scripts/demo.sh runs the whole pipeline (producer, Spark, kill -9 of both, check).

The full run is a Spark test (Java 17+, the spark extra; about two minutes with
small sizes); the Java check runs everywhere with a stand-in ``java`` on the PATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from spark_session import java_problem

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "scripts" / "demo.sh"
JAVA_LINE = (
    "filechannel demo: Spark needs Java 17+; install a JDK 17 (e.g. apt install openjdk-17-jre-headless) and run again"
)


@pytest.mark.parametrize(
    "script",
    [
        "echo 'java version \"1.8.0_392\"' >&2",
        "echo 'openjdk version \"11.0.22\" 2024-01-16' >&2",
        "exit 127",
    ],
    ids=["java8", "java11", "broken"],
)
def test_demo_refuses_java_before_17_in_one_line(tmp_path: Path, script: str) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    java = bindir / "java"
    java.write_text(f"#!/bin/sh\n{script}\n")
    java.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    r = subprocess.run(["bash", str(DEMO), str(tmp_path / "work")], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.strip() == JAVA_LINE
    assert not (tmp_path / "work").exists()


@pytest.mark.spark
@pytest.mark.slow
def test_demo_delivers_every_committed_event_exactly_once(tmp_path: Path) -> None:
    problem = java_problem()
    if problem:
        pytest.fail(problem, pytrace=False)  # as for every Spark test: CI has Java
    work = tmp_path / "work"
    small = ["--rate", "2000", "--phase-seconds", "5", "--file-size", str(1 << 20)]
    r = subprocess.run(
        ["bash", str(DEMO), str(work), *small],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = r.stdout
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{out}\n--- stderr\n{r.stderr[-4000:]}"
    m = re.search(r"^produced (\d+), delivered (\d+), duplicated (\d+), lost (\d+)$", out, re.M)
    assert m, out
    produced, delivered, duplicated, lost = map(int, m.groups())
    assert (duplicated, lost) == (0, 0)
    assert produced == delivered > 0
    # The run did what it says: the driver and the producer were killed and restarted,
    # nothing of them was left, and the table was shown through Spark.
    kills = [line for line in out.splitlines() if "SIGKILL" in line]  # shown whole if a check fails
    assert re.search(r"SIGKILL to Spark driver #1's session .*JVM 1.*left afterwards: 0", out), kills
    assert re.search(r"SIGKILL to producer #1 .*left afterwards: 0", out), kills
    assert "Spark driver #2 started" in out
    assert "producer #2" in out
    assert "Events per region" in out
    # Encrypted at rest by default: the newest bodies and every header name are unreadable on disk.
    at_rest = r"^at rest: \d+ data files, encrypted; 0 of the 1000 newest committed bodies and 0 header names"
    assert re.search(at_rest, out, re.M)
    assert "OK: no process of the run left" in out
    assert "produced" in r.stderr  # the progress line


@pytest.mark.parametrize("encrypted", [True, False])
def test_the_at_rest_check_finds_plaintext_events(tmp_path: Path, encrypted: bool) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import pipeline
    finally:
        sys.path.pop(0)
    import filechannel
    from filechannel.cli import main as cli_main

    args = pipeline.parse_args([str(tmp_path), "--event-size", "100", *(() if encrypted else ("--plaintext",))])
    assert cli_main(["keygen", str(tmp_path / pipeline.KEYSTORE), "--id", "demo"]) == 0
    enc = filechannel.Encryption(keys=str(tmp_path / pipeline.KEYSTORE)) if encrypted else None
    with filechannel.open(tmp_path / "channel", encryption=enc) as ch, ch.transaction() as tx:
        for s in range(50):
            tx.put(pipeline.body_of(s, 100), headers={"region": pipeline.region_of(s)})
    (tmp_path / pipeline.LEDGER).write_text("S 0\nB 0 49\nC 0 49 50\n")
    # The check itself: with --plaintext it only reports; encrypted, it passes only when nothing
    # is readable. Called on plaintext files as if they were encrypted, it must fail.
    assert pipeline.check_at_rest(tmp_path, args) is True
    if not encrypted:
        args.plaintext = False
        assert pipeline.check_at_rest(tmp_path, args) is False


def test_demo_does_not_wipe_a_directory_it_did_not_make(tmp_path: Path) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "pipeline.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "not wiping it" in r.stdout
    assert precious.read_text() == "keep me"


def _fake_java(tmp_path: Path, version: str = 'java version "1.8.0_392"') -> dict[str, str]:
    """An environment whose ``java`` is a stand-in reporting ``version``."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    java = bindir / "java"
    java.write_text(f"#!/bin/sh\necho '{version}' >&2\n")
    java.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run_bounded(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in its own session; past ``timeout`` kill the whole session (and fail)."""
    import signal

    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"{argv} still ran after {timeout:.0f} s") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_the_test_script_checks_java_before_the_long_run(tmp_path: Path) -> None:
    r = _run_bounded(["bash", str(ROOT / "scripts" / "test.sh")], _fake_java(tmp_path), timeout=120)
    assert r.returncode == 2, r.stderr
    # One line of its own (a first venv install may print pip's warnings before it).
    lines = [line for line in r.stderr.strip().splitlines() if line.startswith("scripts/test.sh:")]
    assert len(lines) == 1, r.stderr
    assert r.stderr.strip().endswith(lines[0])
    assert lines[0].startswith("scripts/test.sh: the Spark tests need Java 17+: ")
    assert "is Java 8" in lines[0]
    assert "passed" not in r.stdout  # no test ran


@pytest.mark.parametrize(("flag", "prog"), [((), "scripts/demo.sh"), (("--cluster",), "scripts/demo.sh --cluster")])
def test_demo_help_names_the_script_and_needs_no_java(tmp_path: Path, flag: tuple[str, ...], prog: str) -> None:
    r = _run_bounded(["bash", str(DEMO), *flag, "--help"], _fake_java(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: {prog} ")
    assert "pipeline.py" not in r.stdout
    assert "cluster.py" not in r.stdout


def test_the_demo_work_folders_are_ignored_by_git() -> None:
    for folder in ("demo-work", "demo-cluster"):
        r = subprocess.run(["git", "check-ignore", "-q", f"{folder}/x"], cwd=ROOT, capture_output=True, timeout=30)
        assert r.returncode == 0, f"{folder}/ is not in .gitignore"


def test_progress_lines_stop_before_the_final_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import time

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import pipeline
    finally:
        sys.path.pop(0)
    orch = pipeline.Orchestrator(pipeline.parse_args([str(tmp_path / "work"), "--progress", "0.02"]))
    orch.mon.poll = lambda: None  # type: ignore[method-assign]
    orch.mon.line = lambda: "PROGRESS-LINE"  # type: ignore[method-assign]
    orch.start_progress()
    time.sleep(0.2)
    assert "PROGRESS-LINE" in capsys.readouterr().err  # it was running
    orch.relay_line("[pipeline] final drain (availableNow): 1 micro-batches, 10 events in 1.0 s\n")
    for line in ("produced 10, delivered 10, duplicated 0, lost 0", "  region  run-1  all"):
        orch.relay_line(line + "\n")
        time.sleep(0.1)
    out = capsys.readouterr()
    assert "PROGRESS-LINE" not in out.err  # none after the report began
    assert out.out.splitlines()[-2:] == ["produced 10, delivered 10, duplicated 0, lost 0", "  region  run-1  all"]


def test_the_pure_python_rerun_says_why_its_tests_skip() -> None:
    code = "import helpers; print(helpers.NO_ACCELERATOR)"
    env = {**os.environ, "FILECHANNEL_PURE_PYTHON": "1"}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT / "tests", env=env, capture_output=True, text=True, timeout=60
    )
    assert r.stdout.strip().startswith("the pure-Python rerun (FILECHANNEL_PURE_PYTHON=1)"), r.stderr
    assert "not built" not in r.stdout


def test_the_cluster_demo_agents_use_mutual_tls_unless_insecure(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import cluster
    finally:
        sys.path.pop(0)
    import filechannel
    from filechannel.agent import AgentAuthError, AgentUnavailableError, connect

    assert cluster.parse_args([str(tmp_path)]).insecure is False  # mutual TLS by default
    assert cluster.parse_args([str(tmp_path), "--insecure"]).insecure is True
    d = tmp_path / "hosts" / "h1" / "channel"
    filechannel.open(d, minimum_required_space=0).close()
    (tmp_path / "logs").mkdir()
    pki = cluster.make_pki(tmp_path / "pki", ("h1",))
    for secret in ("agent-h1.key", "client.key", "token"):
        assert os.stat(pki[secret]).st_mode & 0o077 == 0
    agent = cluster.Agent("h1", d, tmp_path, pki)
    agent.start()
    try:
        assert agent.uri.startswith("grpc+tls://localhost:")
        query = {"tls_ca": pki["ca"], "tls_cert": pki["client.crt"], "tls_key": pki["client.key"]}
        c = connect(agent.uri, token_file=pki["token"], timeout=10, **query)
        cid = filechannel.reader.channel_id_of(d).hex()
        assert list(c.channels()) == [cid]
        c.register(cid, cluster.CONSUMER, "spark-query:x")  # the query's consumer: allowed
        with pytest.raises(AgentAuthError):
            c.register(cid, "another-consumer", "spark-query:y")  # --allow-consumer spark=cluster-table
        with pytest.raises(AgentUnavailableError):
            connect(agent.uri, tls_ca=pki["ca"], token_file=pki["token"], timeout=10).channels()  # no certificate
        with pytest.raises(AgentAuthError):
            connect(agent.uri, timeout=10, **query).channels()  # no token
    finally:
        agent.kill9()
    insecure = cluster.Agent("h1", d, tmp_path, None)
    assert insecure.uri.startswith("grpc://127.0.0.1:")
