"""ember's benchmarks, installed as ``ember.benchmarks`` and run by ``ember bench [name]``.

Every benchmark measures ratios against a baseline run in the same process (raw NumPy,
array-api-strict, raw sockets …), reporting medians of interleaved repeats, because the
machines are shared and noisy.
"""

SUITES = ("core", "remote", "capture", "train", "wan", "fleet", "torch", "resume")
