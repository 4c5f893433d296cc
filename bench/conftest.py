"""Shared bench plumbing: every transfer benchmark records the bytes it moves in
``benchmark.extra_info["bytes"]`` and its case in ``extra_info["case"]``; the summary at
the end prints GB/s and the ratio to the memcpy baseline of the same case, all measured
in this one run (absolute numbers on these machines are noisy; ratios are the point).

Run: ``.venv/bin/python -m pytest bench --benchmark-only``.
"""

from __future__ import annotations

from collections import defaultdict


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    rows = []
    for bench in session.benchmarks:
        info = bench.extra_info or {}
        if "bytes" not in info or not bench.stats:
            continue
        secs = bench.stats.median
        rows.append((info.get("case", bench.group or ""), bench.name, info["bytes"] / secs / 1e9,
                     info.get("baseline", False)))
    if not rows:
        return
    by_case = defaultdict(list)
    for case, name, gbps, base in rows:
        by_case[case].append((name, gbps, base))
    tr = terminalreporter
    tr.section("kvtransport throughput (median), ratio to the memcpy baseline of the same case")
    for case in sorted(by_case):
        base = [g for _, g, b in by_case[case] if b]
        for name, gbps, _ in sorted(by_case[case], key=lambda r: -r[1]):
            ratio = f"{gbps / base[0]:6.2f}x memcpy" if base else ""
            tr.write_line(f"{case:28s} {name:60s} {gbps:7.2f} GB/s  {ratio}")
