r"""Recovery after a link flap, per backend, between two "hosts" for real.

Topology, made by this test and gone after it (``test_two_hosts``' namespace helpers)::

    ns A: prefill engine (kv_producer) <--veth 10.213.94.0/24--> ns B: decode engine (kv_consumer)

Each engine is a real vLLM Scheduler with the connector's scheduler and worker roles
(``tests/vllm/harness.py``), run by this file as a process inside its namespace and driven
over its stdin/stdout (no network between the test and the engines). Side channel and,
for the network backends, KV cross the A-B link; ``loopback`` and ``ucx`` over shared
memory move KV through the kernel (same host), so for them only the side channel crosses.

Per backend: a request loads remote KV; the link goes down (``ip link set down``); a
request made while it is down fails by its deadline and is recomputed (KV intact); the
link comes back; the first request after it loads its prompt KV remotely, byte-exact,
with neither engine restarted; both engines end with every block free. What is printed
per backend: seconds from "link up" to that first request's KV being loaded (the figure
docs/bench/HEALING.md records), and the decode engine's failure count (what ``/metrics``
exports as failed loads).

Skipped, with the reason, where network namespaces cannot be made (no root /
CAP_SYS_ADMIN, no iproute2) or the backend is not usable here.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
A_B = ("10.213.94.1/24", "10.213.94.2/24")
PORT = 5700
TIMEOUT_S = 3.0  # the load deadline: what a request made while the link is down waits
LEASE_S = 6.0


def _backend(case: str, dev: str, addr: str) -> dict:
    return {
        "ucx-tcp": {"backend": "ucx", "backend_options": {"tls": "tcp", "net_devices": dev}},
        "ucx-shm": {"backend": "ucx", "backend_options": {"tls": "shm"}},
        "nixl": {"backend": "nixl", "backend_options": {"tls": "tcp", "ucx_config": {"NET_DEVICES": dev}}},
        "mooncake": {"backend": "mooncake", "backend_options": {"hostname": addr}},
        "loopback": {"backend": "loopback"},
    }[case]


# ------------------------------------------------------------------ the engine process
def _serve(role: str, extra: dict) -> None:
    """One engine, stepped continuously; commands on stdin, one JSON answer per line."""
    sys.path.insert(0, str(HERE.parent / "vllm"))
    from harness import Engine, prompt_of, run_until
    from vllm.v1.request import RequestStatus

    e = Engine(role, extra, engine_id="P" if role == "kv_producer" else "C", num_blocks=64)
    say = lambda obj: (sys.stdout.write(json.dumps(obj) + "\n"), sys.stdout.flush())  # noqa: E731
    got: dict = {}
    say({"ready": True})
    while True:
        r, _, _ = select.select([sys.stdin], [], [], 0.005)
        if not r:
            got.update(e.step())
            continue
        msg = json.loads(sys.stdin.readline() or '{"cmd": "quit"}')
        cmd = msg["cmd"]
        if cmd == "prefill":
            e.add(msg["rid"], prompt_of(50, msg["seed"]), 1, {"do_remote_decode": True})
            run_until([e], lambda: msg["rid"] in got, on_params=got.update)
            say(got[msg["rid"]])
        elif cmd == "load":
            rid, prompt, seen = msg["rid"], prompt_of(50, msg["seed"]), []
            e.add(rid, prompt, 2, msg["params"])

            def ended() -> bool:
                req = e.scheduler.requests.get(rid)
                if (not seen and req is not None and e.status(rid) == RequestStatus.RUNNING
                        and req.num_computed_tokens >= len(prompt)):
                    seen.append(e.check_kv(rid, prompt, len(prompt)))
                return req is None

            t0 = time.monotonic()
            run_until([e], ended, timeout=240)  # hang guard: a READ NIXL cannot abort ends only when UCX gives up
            outcomes: dict[str, int] = {}  # how loads ended, by cause: what /metrics exports
            for o in e.kv_outputs:
                for k, n in (o.kv_connector_stats.data.get("outcomes", {}) if o.kv_connector_stats else {}).items():
                    outcomes[k] = outcomes.get(k, 0) + n
            say({"remote": e.first_start[rid] >= len(prompt) - 1, "kv": seen, "secs": time.monotonic() - t0,
                 "outcomes": outcomes})
        elif cmd == "idle":
            run_until([e], lambda: not e.scheduler.requests and e.free_blocks() == e.free0,
                      timeout=float(msg["limit"]))
            say({"idle": True})
        elif cmd == "quit":
            e.close()
            say({"bye": True})
            return


# ------------------------------------------------------------------ the test
if __name__ != "__main__":
    import pytest

    from kvtransport.testing.required import skip_unless_usable

    from .test_two_hosts import ip, veth_namespaces

    pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

    #: the cluster's side-channel secret: both engines and the doctor (never the caller's)
    ENV = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "KVTRANSPORT_SECRET": secrets.token_hex(16)}
    ENV.pop("KVTRANSPORT_SECRET_FILE", None)
    ENV.pop("KVTRANSPORT_AUTH", None)

    class EngineProc:
        def __init__(self, ns: str, role: str, extra: dict) -> None:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, __file__, role, json.dumps(extra)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)

        def read(self) -> dict:
            while True:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"engine ended (rc={self.proc.poll()}): {self.proc.stderr.read()[-3000:]}")
                if line.startswith("{"):
                    return json.loads(line)

        def call(self, **msg) -> dict:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            return self.read()

        def close(self) -> None:
            if self.proc.poll() is None:
                try:
                    self.call(cmd="quit")
                    self.proc.wait(20)
                except Exception:
                    self.proc.kill()
                    self.proc.wait(10)

    #: nixl cannot abort a READ posted while the link is down: it ends when UCX's tcp connection
    #: gives up on its unacknowledged data (the backend's tcp_user_timeout_s, default 30 s)
    @pytest.mark.parametrize("case", ["ucx-tcp", "ucx-shm", "nixl", "mooncake", "loopback"])
    def test_link_flap_first_request_after_loads_remote(case, request):
        if not request.config.getoption("--link-flap"):
            pytest.skip("long (a link cut per backend, about 5 min): run with --link-flap (docs/bench/HEALING.md)")
        skip_unless_usable("ucx" if case.startswith("ucx") else case)
        with veth_namespaces("kvt-flap", "kf", A_B) as ((ns_a, dev_a), (ns_b, dev_b)):
            common = {"mode": "read", "transfer_timeout_s": TIMEOUT_S, "lease_s": LEASE_S,
                      "load_failure_policy": "recompute", "side_channel_port": PORT}
            a_addr, b_addr = A_B[0].split("/")[0], A_B[1].split("/")[0]
            procs = []
            try:
                P = EngineProc(ns_a, "kv_producer", {**common, "side_channel_host": a_addr,
                                                     **_backend(case, dev_a, a_addr)})
                procs.append(P)
                C = EngineProc(ns_b, "kv_consumer", {**common, "side_channel_host": b_addr,
                                                     **_backend(case, dev_b, b_addr)})
                procs.append(C)
                P.read(), C.read()  # both started (in parallel): ready

                def doctor() -> subprocess.CompletedProcess:
                    """``kvtransport doctor`` on the decode host, as an operator runs it."""
                    opts = _backend(case, dev_b, b_addr).get("backend_options", {})
                    return subprocess.run(
                        ["ip", "netns", "exec", ns_b, sys.executable, "-m", "kvtransport.cli", "doctor",
                         f"{a_addr}:{PORT}", f"{b_addr}:{PORT}", "--backend-options", json.dumps(opts),
                         "--timeout", "3"], capture_output=True, text=True, timeout=120, env=ENV)

                def load(rid: str, seed: int) -> dict:
                    out = C.call(cmd="load", rid=rid, seed=seed, params=P.call(cmd="prefill", rid=rid, seed=seed))
                    assert out["kv"] == [[]], f"{rid}: prompt KV differs from the prompt's: {out}"
                    return out

                assert load("r1", 1)["remote"], "nothing broken yet, but the KV was recomputed"
                assert ip("link", "set", dev_a, "down", ns=ns_a).returncode == 0
                down = load("r2", 2)  # recomputed by its deadline (or loaded: the KV path needs no link)
                during = doctor()
                # not healthy; over tcp UCX may refuse the veth without carrier before any verdict
                assert during.returncode != 0 and "verdict: healthy" not in during.stdout, during.stdout
                assert ip("link", "set", dev_a, "up", ns=ns_a).returncode == 0
                t_up = time.monotonic()
                after = load("r3", 3)
                healed_s = time.monotonic() - t_up
                print(f"\n[flap] {case}: request during the cut remote={down['remote']} "
                      f"({down['secs']:.2f}s); first request after link up remote={after['remote']}, "
                      f"{healed_s:.2f}s from link up (its load {after['secs']:.2f}s); "
                      f"decode load outcomes: {after['outcomes']}")
                assert after["remote"], f"{case}: the first request after the link came back was recomputed"
                failed = sum(n for k, n in after["outcomes"].items() if k.startswith("load:") and k != "load:ok")
                assert after["outcomes"].get("load:ok") == 2 + down["remote"], after["outcomes"]
                assert failed == 1 - down["remote"], f"the failed load is not counted: {after['outcomes']}"
                assert load("r4", 4)["remote"]
                after_doc = doctor()
                assert after_doc.returncode == 0 and after_doc.stdout.rstrip().endswith("verdict: healthy"), \
                    after_doc.stdout + after_doc.stderr[-2000:]
                print(f"[flap] {case}: doctor during the cut:\n{during.stdout or during.stderr[-300:]}[flap] doctor after: "
                      f"{after_doc.stdout.rstrip().splitlines()[-1]}")
                C.call(cmd="idle", limit=30)
                P.call(cmd="idle", limit=LEASE_S + 30)  # the cut request's hold: released or lapsed
            finally:
                for p in procs:
                    p.close()


if __name__ == "__main__":
    _serve(sys.argv[1], json.loads(sys.argv[2]))
