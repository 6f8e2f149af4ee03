"""A full disk on a real, size-limited file system: back-pressure, not a failure.

Each test runs a child in a private mount namespace (``unshare --mount``, or
``unshare -rm`` when not root) with an 8 MiB tmpfs mounted at a directory
nobody else sees:

* the channel: the disk fills (the channel's data, then a file of something
  else), a put waits (``keep_alive``) without the channel failing, takes and
  their commits retire data files, and the waiting put goes through by itself;
* the agent's HTTP source, with no floor: a write runs out of space (ENOSPC),
  is undone, and the put gets 503 with ``Retry-After`` (not 500); takes through
  the agent retire files, and puts get 200 again.

Skipped with the reason only where the kernel refuses the namespace or the mount.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SKIP_RC = 77
MiB = 1 << 20
OPTS = {"max_file_size": 256 * 1024, "minimum_required_space": MiB}


def _in_tmpfs(tmp_path: Path, scenario: str) -> dict[str, object]:
    """Run ``scenario`` of this file in a child with an 8 MiB tmpfs at a private mount point; its JSON result."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    ns = ["unshare", "--mount", "--propagation", "private"] if os.geteuid() == 0 else ["unshare", "-rm"]
    script = 'mount -t tmpfs -o size=8m tmpfs "$0" || exit 77; exec "$1" "$2" "$3" "$0"'
    cmd = [*ns, "sh", "-c", script, str(mnt), sys.executable, __file__, scenario]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if r.returncode == SKIP_RC or (r.returncode != 0 and "unshare failed" in r.stderr):
        pytest.skip(f"the kernel refused a private mount namespace with a tmpfs: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, f"the child failed:\n{r.stdout}\n{r.stderr}"
    out: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def test_a_full_disk_makes_puts_wait_and_takes_make_room(tmp_path: Path) -> None:
    got = _in_tmpfs(tmp_path, "channel")
    assert got["under_floor"] is True
    assert got["waited_s"] >= 0.4  # type: ignore[operator]
    assert got["failed"] is False
    assert got["files_retired"] > 0  # type: ignore[operator]
    assert got["after"] == ["waited", "last"]


def test_a_full_disk_gives_503_then_200_through_the_http_source(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow.flight")
    pytest.importorskip("aiohttp")
    got = _in_tmpfs(tmp_path, "http")
    assert got["status"] == 503
    assert got["retry_after"]
    assert "no space left" in str(got["message"])
    assert got["failed"] is False
    assert got["files_retired"] > 0  # type: ignore[operator]
    assert got["after"] == 200


# -- the children (run inside the namespace) ------------------------------------------------------


def _fill_with_other_data(mnt: str) -> None:
    """Use up the file system's free space with a file that is not the channel's."""
    with open(os.path.join(mnt, "filler"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def _child_channel(mnt: str) -> dict[str, object]:
    from helpers import WaitingPut

    import filechannel

    ch = filechannel.open(os.path.join(mnt, "ch"), keep_alive=20, **OPTS)
    body = b"e" * 8000
    n = 0
    while shutil.disk_usage(mnt).free > 3 * MiB:
        with ch.transaction() as tx:
            tx.put(body)
        n += 1
    _fill_with_other_data(mnt)
    time.sleep(1.1)  # the channel trusts a free-space reading (less its own writes) for up to a second
    t0 = time.monotonic()
    waiting = WaitingPut(ch, b"waited")
    time.sleep(0.5)
    assert not waiting.done.is_set(), "the put did not wait on a full disk"
    st = ch.stats()
    assert not st["failed"]
    under_floor = shutil.disk_usage(mnt).free < OPTS["minimum_required_space"]
    taken = 0
    others: list[str] = []  # the waiting put may commit (and be taken) while this drains
    while taken < n:
        with ch.transaction() as t:
            for e in t.take_batch(100):
                if e.body == body:
                    taken += 1
                else:
                    others.append(e.body.decode())
    ch.retire_files()
    waiting.finish(10)
    waited = time.monotonic() - t0
    with ch.transaction() as t:
        t.put(b"last")
    st = ch.stats()
    with ch.transaction() as t:
        after = others + [e.body.decode() for e in t.take_batch(10)]
    ch.close()
    return {
        "under_floor": under_floor,
        "waited_s": waited,
        "failed": st["failed"],
        "files_retired": st["files_retired"],
        "after": after,
    }


def _child_http(mnt: str) -> dict[str, object]:
    import http.client

    import filechannel
    from filechannel.agent import serve
    from filechannel.reader import channel_id_of

    d = os.path.join(mnt, "c")
    filechannel.open(d, **OPTS).close()
    # No floor: the file system itself runs out of space under a write (ENOSPC), which is undone.
    options = {**OPTS, "minimum_required_space": 0, "keep_alive": 0.2}
    a = serve([d], "grpc://127.0.0.1:0", writable=True, http="127.0.0.1:0", channel_options=options)
    try:
        port = a.http.port

        def post(body: bytes) -> tuple[int, dict[str, str], bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                conn.request("POST", "/v1/channels/c/events", body, {"Content-Type": "application/octet-stream"})
                r = conn.getresponse()
                return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
            finally:
                conn.close()

        body = b"h" * 8000
        for _ in range(2000):
            status, headers, data = post(body)
            if status != 200:
                break
        else:
            raise AssertionError("the disk never filled")
        ch = a.channels[channel_id_of(d).hex()].channel
        failed = ch.stats()["failed"]
        while True:
            with ch.transaction() as t:
                if not t.take_batch(100):
                    break
        ch.retire_files()
        after = post(b"after")[0]
        st = ch.stats()
    finally:
        a.stop()
    return {
        "status": status,
        "retry_after": headers.get("retry-after"),
        "message": json.loads(data).get("error", data.decode(errors="replace")),
        "failed": failed,
        "files_retired": st["files_retired"],
        "after": after,
    }


if __name__ == "__main__":
    scenario, where = sys.argv[1], sys.argv[2]
    result = _child_channel(where) if scenario == "channel" else _child_http(where)
    print(json.dumps(result))
