"""Benchmarks of SPEC §11: ``python -m bench`` (``make bench``) prints the figures.

Every figure runs the same workload (``bench.workload``) on a Postgres
database of its own, created for it and dropped afterwards, and on Redis keys
of its own. Timings are medians over repeats; the machine is shared, so read
them as such.
"""
