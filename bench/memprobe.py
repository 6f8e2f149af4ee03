"""Resident memory of an open channel, measured in a fresh process.

``python -m bench.memprobe DIR N [checkpoint|full]`` opens the channel in DIR (holding N queued
events), and prints one JSON object: resident memory before and after the open,
the peak, and the bytes per queued event.

The "before" figure is taken after handing free heap pages back to the system
(glibc's ``malloc_trim``, where there is one): replay trims the heap when it
ends, and without this the slack left by imports would be credited to the
channel (at 10k events that made the bytes per event negative).
"""

from __future__ import annotations

import gc
import json
import sys


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def main() -> None:
    path, n = sys.argv[1], int(sys.argv[2])
    replay = sys.argv[3] if len(sys.argv) > 3 else "checkpoint"
    import filechannel

    gc.collect()
    _trim()
    before = _status("VmRSS")
    ch = filechannel.open(path, capacity=4_000_000, replay=replay)
    gc.collect()
    after = _status("VmRSS")
    peak = _status("VmHWM")
    size = ch.size
    queue_bytes = ch._queue.memory_bytes()
    ch.close()
    print(
        json.dumps(
            {
                "queued": size,
                "rss_before": before,
                "rss_after": after,
                "rss_peak": peak,
                "bytes_per_event": (after - before) / max(n, 1),
                "peak_bytes_per_event": (peak - before) / max(n, 1),
                "queue_columns_bytes_per_event": queue_bytes / max(n, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
