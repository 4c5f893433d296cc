"""harness.stall_report: what an end-to-end test prints when requests stall.

It must name every process of a server's group and, per thread, the Python frame the
thread was in, from a real process group (a parent and a child process, the parent with a
second thread), without a vLLM server: the report is the harness's, the processes real. A
process that writes no Python stack at SIGABRT (here one that ignores the signal, as one
whose threads are all inside the kernel cannot take it) is shown by its threads' kernel
state instead.
"""

from __future__ import annotations

import textwrap
import time

from . import harness

PROGRAM = textwrap.dedent("""
    import subprocess, sys, threading, time

    def side_channel_wait():
        time.sleep(300)

    threading.Thread(target=side_channel_wait, daemon=True).start()
    CHILD = ("import time\\ndef engine_step():\\n    print('child', 'up', sep='-', flush=True)\\n"
             "    time.sleep(300)\\nengine_step()")
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    deaf = subprocess.Popen(["sh", "-c", "trap '' ABRT; exec sleep 300"])  # SIGABRT ignored: no dump
    print("parent", "up", sep="-", flush=True)
    time.sleep(300)
""")


def test_stall_report_names_each_process_and_each_threads_frame(tmp_path):
    """The light report leaves the server running; the full one adds every thread's frame."""
    server = harness.VllmServer(name="stalled", cmd=[harness.PYTHON, "-c", PROGRAM], env=harness.base_env(None),
                                log_path=tmp_path / "stalled.log", port=harness.free_port())
    server.start()
    try:
        deadline = time.monotonic() + 30
        up = ("\nparent-up\n", "\nchild-up\n")  # whole lines: the log's first line holds the program text
        while not all(w in server.log_tail() for w in up) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(w in server.log_tail() for w in up), server.log_tail()
        light = harness.stall_report([server], stacks=False)  # for engines other tests still use
        assert server.alive, "stall_report(stacks=False) must leave the server running"
        report = harness.stall_report([server])
    finally:
        server.stop()
    print(light, report, sep="\n")
    light_lines = light.splitlines()
    rows = [line for line in light_lines if line.startswith("  ") and not line.startswith("    ")]
    assert len(rows) == 3, light  # parent, child, the process that ignores SIGABRT
    assert sum(1 for line in light_lines if line.startswith("    threads: ")) == 3, light
    assert "innermost" not in light, light
    kept = (tmp_path / "stall-report.txt").read_text()
    assert kept.count("\n=== ") + kept.startswith("=== ") == 2 and "(no Python stack written)" in kept, kept
    lines = report.splitlines()
    assert lines[0].startswith("[stalled] metrics unavailable"), report  # nothing serves /metrics here
    assert sum(1 for line in lines if line.startswith("[stalled] pid ")) == 3, report
    assert any("in side_channel_wait" in line for line in lines), report  # the parent's second thread
    assert any("in engine_step" in line for line in lines), report  # the child's main thread
    deaf = [line for line in lines if "(no Python stack written)" in line]
    assert len(deaf) == 1 and "threads: 1 S" in deaf[0], report  # sleep(1) in the kernel: state and wait channel
