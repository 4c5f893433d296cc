"""Acceptance 4: two connector workers in two processes move real paged KV tensors over
the loopback backend; every block arrives byte-identical (per block, per layer digest)."""

import hashlib
import json
import os
import subprocess
import sys

from harness import Engine, free_port_base, run_until


def test_two_processes_byte_equal_per_block():
    base = free_port_base(8)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "_producer_proc.py"),
                             str(base), "200"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    C = None
    try:
        line = ""
        while not line.startswith("{"):
            line = proc.stdout.readline()
            assert line, "producer process exited early"
        data = json.loads(line)
        params, digests, prompt = data["params"], data["digests"], data["prompt"]
        C = Engine("kv_consumer", {"backend": "loopback", "mode": "read", "side_channel_port": base + 4,
                                   "transfer_timeout_s": 10, "lease_s": 20}, engine_id="C-proc")
        C.add("c1", prompt, 1, params)
        run_until([C], lambda: any("c1" in (o.finished_recving or ()) for o in C.kv_outputs), timeout=30)
        assert not any(o.invalid_block_ids for o in C.kv_outputs)
        local = C.block_ids("c1")
        assert len(local) == len(digests) == 13  # ceil(200 / 16)
        got = [[hashlib.sha256(t[b].numpy().tobytes()).hexdigest() for t in C.kv_caches.values()] for b in local]
        assert got == digests
        run_until([C], lambda: C.status("c1") is None, timeout=10)
        assert proc.stdout.readline().strip() == "FREED"  # producer freed after our confirmation
        assert proc.wait(timeout=30) == 0
        assert C.free_blocks() == C.free0
    finally:
        if C is not None:
            C.close()
        if proc.poll() is None:
            proc.kill()
