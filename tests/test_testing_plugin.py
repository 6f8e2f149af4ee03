"""The pytest plugin as users use it: a user's test file run with pytester, in a subprocess.

The plugin comes in through the ``pytest11`` entry point of the installed
package (nothing in the user's project names it).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest_plugins = ["pytester"]

USER_TESTS = """
import filechannel
import pytest
from filechannel.testing import assert_exactly_once


def test_dir_is_fresh(fc_channel_dir, tmp_path):
    assert fc_channel_dir.parent == tmp_path
    assert not fc_channel_dir.exists()


def test_channel_is_open_and_usable(fc_channel):
    with fc_channel.transaction() as tx:
        tx.put(b"hello")
    assert fc_channel.size == 1


@pytest.mark.fc_options(capacity=2, transaction_capacity=2, keep_alive=0)
def test_options_from_the_marker(fc_channel):
    with fc_channel.transaction() as tx:
        tx.put_many([b"a", b"b"])
    with pytest.raises(filechannel.ChannelFullError):
        with fc_channel.transaction() as tx:
            tx.put(b"c")


def test_committed_events_survive_a_power_cut(fc_crashable_channel):
    ch = fc_crashable_channel
    with ch.transaction() as tx:
        tx.put_many([b"a", b"b"])
    open_tx = ch.transaction()
    open_tx.put(b"never committed")
    ch = ch.crash(lose="unsynced")
    tx = ch.transaction()
    got = [e.body for e in tx.take_batch(10)]
    tx.rollback()
    assert_exactly_once([b"a", b"b"], got, ordered=True)
"""

BUGGY_USER_TEST = '''
from filechannel.testing import assert_exactly_once


class AckBeforeCommitConsumer:
    """A user's consumer with a bug: it hands events on before its take commits."""

    def __init__(self, channel, out):
        self.channel, self.out = channel, out

    def poll(self):
        tx = self.channel.transaction()
        evs = tx.take_batch(10)
        self.out.extend(e.body for e in evs)   # delivered ...
        return tx                              # ... but the take is committed later


def test_consumer_survives_a_crash(fc_crashable_channel):
    delivered = []
    with fc_crashable_channel.transaction() as tx:
        tx.put_many([b"e1", b"e2", b"e3"])
    AckBeforeCommitConsumer(fc_crashable_channel, delivered).poll()   # crash before the take commits
    ch = fc_crashable_channel.crash()
    with ch.transaction() as tx:
        delivered.extend(e.body for e in tx.take_batch(10))
    assert_exactly_once([b"e1", b"e2", b"e3"], delivered)
'''


def test_user_tests_with_the_fixtures_pass(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=4)


def test_a_user_bug_fails_for_the_right_reason(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_buggy=BUGGY_USER_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*not exactly once: produced 3, delivered 6: missing 0, duplicated 3 (3 items), unexpected 0",
            "*b'e1'  delivered again at #3, 1 extra",
        ]
    )


def test_fixture_teardown_closes_the_channel(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_reopen="""
        import filechannel

        seen = {}

        def test_a(fc_channel, fc_channel_dir):
            seen["dir"] = fc_channel_dir
            seen["ch"] = fc_channel

        def test_b():
            assert seen["ch"].closed
            # the lock is free again: the directory opens
            filechannel.open(seen["dir"]).close()
        """
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_loading_the_plugin_imports_no_spark() -> None:
    code = (
        "import sys, pytest\n"
        "rc = pytest.main(['--co', '-q', '-p', 'no:cacheprovider', '--rootdir', '.', '-c', '/dev/null', '/dev/null'])\n"
        "assert 'filechannel.testing.plugin' in sys.modules, 'the plugin was not loaded'\n"
        "import filechannel.testing\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('pyspark', 'pyarrow', 'py4j'))\n"
        "print('BAD', ','.join(bad))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "BAD \n" in r.stdout or r.stdout.rstrip().endswith("BAD"), r.stdout + r.stderr
