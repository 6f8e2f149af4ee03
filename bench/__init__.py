"""Benchmarks: filechannel against the disk's physical limits and its peers (``python -m bench``)."""
