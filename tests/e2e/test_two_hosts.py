r"""Prefill and decode on two "hosts" for real (issue 17, point 4 / acceptance 3).

Topology, made by this test and gone after it::

      root namespace: examples/disagg_proxy.py, the test (OpenAI client)
        |  10.213.91.0/24 (HTTP only)          |  10.213.92.0/24 (HTTP only)
    ns A: prefill engine (kv_producer)  <--veth 10.213.90.0/24-->  ns B: decode engine (kv_consumer)
          default route via B                  KV: side channel +        default route via A
                                               ucx over tcp

Neither engine is given ``side_channel_host``: each must advertise its routable address
(the A-B link, behind its default route), not 127.0.0.1, or the decode engine could never
reach the prefill engine. UCX is limited to the A-B device, so KV crosses that link only.

What a user would check, and what is asserted:

* the prefill engine advertises its A-B address in ``kv_transfer_params``;
* through the proxy, greedy tokens equal the single engine's (the ``baseline`` fixture)
  and the decode engine loaded the prompt KV remotely
  (``prompt_tokens_by_source{source="external_kv_transfer"}``);
* ``kvtransport doctor``, run on the decode host over ucx/tcp, calls the pair healthy;
* the A-B link is cut (``ip link set down``) while the decode engine loads a long
  prompt over a slowed link: that request is recomputed (policy ``recompute``) to the
  reference tokens, with nothing taken from the failed load;
* the link is restored: both engines serve again through the proxy, with the KV loaded
  remotely again, and both end idle with every KV block free.

Skipped, with the reason, where network namespaces cannot be made (no root /
CAP_SYS_ADMIN, no iproute2 / tc) or ucx is unusable. Cost: the shared baseline engine,
then one pair (~35 s start) and under a minute of requests.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtransport.testing.required import skip_unless_usable

from . import harness, prompts
from .conftest import _LIVE, BASELINE_SEEDS, LEASE_S, TRANSFER_TIMEOUT_S
from .harness import BLOCK_SIZE
from .test_disagg import _decode_with, _prefill_hop, _prompt_tokens, _requests_seen, _until, wait_idle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ucx"))
from netns_helpers import ip, veth_namespaces  # noqa: E402  (tests/ucx)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

A_B = ("10.213.90.1/24", "10.213.90.2/24")
ROOT_A = ("10.213.91.1/24", "10.213.91.2/24")  # (root end, A end)
ROOT_B = ("10.213.92.1/24", "10.213.92.2/24")  # (root end, B end)
SIDE_CHANNEL_PORT = 5600  # the default, in each namespace


def _addr(cidr: str) -> str:
    return cidr.split("/")[0]


@dataclass
class NsServer(harness.VllmServer):
    """A harness server run inside a network namespace, reached at ``host``."""

    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _in_ns(server: harness.VllmServer, ns: str, host: str) -> NsServer:
    cmd = list(server.cmd)
    cmd[cmd.index("--host") + 1] = host
    return NsServer(name=server.name, cmd=["ip", "netns", "exec", ns, *cmd], env=server.env,
                    log_path=server.log_path, port=server.port, host=host)


def _connector_config(role: str, dev: str) -> dict:
    """No side_channel_host and no port: the defaults must work across hosts."""
    return {"kv_connector": "KVTransportConnector", "kv_role": role,
            "kv_connector_extra_config": {
                "backend": "ucx", "backend_options": {"tls": "tcp", "net_devices": dev}, "mode": "read",
                "transfer_timeout_s": TRANSFER_TIMEOUT_S, "lease_s": LEASE_S, "load_failure_policy": "recompute"}}


def _must(r: subprocess.CompletedProcess, what: str) -> None:
    if r.returncode != 0:
        pytest.skip(f"cannot {what}: {r.stderr.strip()}")


def _root_link(ns: str, tag: str, addrs: tuple[str, str]) -> str:
    """A veth from the root namespace into ``ns`` (HTTP between the proxy and an engine);
    returns the root end's name (deleting it removes the pair)."""
    root_dev, ns_dev = f"kr{tag}", f"kn{tag}"
    _must(ip("link", "add", root_dev, "type", "veth", "peer", "name", ns_dev), "make a root veth")
    for args, where in ((["link", "set", ns_dev, "netns", ns], None), (["addr", "add", addrs[0], "dev", root_dev], None),
                        (["link", "set", root_dev, "up"], None), (["addr", "add", addrs[1], "dev", ns_dev], ns),
                        (["link", "set", ns_dev, "up"], ns)):
        _must(ip(*args, ns=where), f"set up the root link ({' '.join(args)})")
    return root_dev


@pytest.fixture
def hosts():
    """((ns_a, dev_a), (ns_b, dev_b)): two "hosts" joined by a veth pair, each also linked
    to the root namespace, with a default route over the A-B link."""
    if shutil.which("tc") is None:
        pytest.skip("iproute2 'tc' not found; cannot slow the link for the cut")
    skip_unless_usable("ucx")
    with veth_namespaces("kvt-2h", "k2", A_B) as ((ns_a, dev_a), (ns_b, dev_b)):
        roots = []
        try:
            tag = secrets.token_hex(3)
            roots.append(_root_link(ns_a, f"a{tag}", ROOT_A))
            roots.append(_root_link(ns_b, f"b{tag}", ROOT_B))
            _must(ip("route", "add", "default", "via", _addr(A_B[1]), "dev", dev_a, ns=ns_a), "route A")
            _must(ip("route", "add", "default", "via", _addr(A_B[0]), "dev", dev_b, ns=ns_b), "route B")
            yield (ns_a, dev_a), (ns_b, dev_b)
        finally:
            for dev in roots:
                ip("link", "del", dev)


def _check_answers(client, ps, baseline, decode) -> list[dict]:
    """Each prompt through the proxy: reference tokens, and prompt KV taken remotely."""
    rows = []
    for p in ps:
        ext0, loc0 = _prompt_tokens(decode)
        got = prompts.complete(client, p)
        ext1, loc1 = _prompt_tokens(decode)
        rows.append(dict(len=len(p), remote=ext1 - ext0, local=loc1 - loc0, same=got == baseline[tuple(p)]))
    assert all(r["same"] for r in rows), f"disaggregated output differs from the single engine: {rows}"
    not_remote = [r for r in rows if r["len"] >= BLOCK_SIZE and r["remote"] <= 0]
    assert not not_remote, f"decode engine recomputed instead of loading remote KV: {not_remote}"
    return rows


def test_two_hosts_tokens_doctor_and_link_cut(hosts, tiny_model, log_dir, baseline, vocab_size):
    (ns_a, dev_a), (ns_b, dev_b) = hosts
    seed = BASELINE_SEEDS[0]  # prompts the baseline engine answered; new to these engines
    env = {"KVTRANSPORT_SECRET": secrets.token_hex(16)}
    prefill = _in_ns(harness.vllm_server("2h-prefill", tiny_model, log_dir, cpu=0, env_extra=env,
                                         kv_transfer_config=_connector_config("kv_producer", dev_a)),
                     ns_a, _addr(ROOT_A[1]))
    decode = _in_ns(harness.vllm_server("2h-decode", tiny_model, log_dir, cpu=1, env_extra=env,
                                        kv_transfer_config=_connector_config("kv_consumer", dev_b)),
                    ns_b, _addr(ROOT_B[1]))
    proxy = harness.proxy_process("2h-proxy", log_dir, prefill.url, decode.url,
                                  prefill_timeout_s=60, decode_timeout_s=120)
    procs = [prefill, decode, proxy]
    _LIVE.extend(procs)
    try:
        took = harness.start_all(procs)
        print("\n[e2e] two hosts: healthy after " + ", ".join(f"{k} {v:.1f}s" for k, v in took.items()))
        client = prompts.client(proxy.url)
        correct = prompts.correctness_prompts(vocab_size, seed)
        long_prompt = correct[-1]  # 20 blocks: kept for the cut, never sent before it

        # 1. the default side-channel address is the routable one, and KV crosses the link
        kv = _prefill_hop(prefill, prompts.restart_prompts(vocab_size, seed)[0])
        assert (kv["remote_host"], kv["remote_port"]) == (_addr(A_B[0]), SIDE_CHANNEL_PORT), kv
        rows = _check_answers(client, correct[:-1], baseline, decode)
        print(f"[e2e] two hosts, prompt tokens on decode: {rows}")

        # 2. the doctor, on the decode host, over ucx/tcp: healthy
        doctor = subprocess.run(
            ["ip", "netns", "exec", ns_b, sys.executable, "-m", "kvtransport.cli", "doctor",
             f"{_addr(A_B[0])}:{SIDE_CHANNEL_PORT}", f"{_addr(A_B[1])}:{SIDE_CHANNEL_PORT}",
             "--backend-options", f'{{"tls": "tcp", "net_devices": "{dev_b}"}}', "--timeout", "30"],
            capture_output=True, text=True, env={**decode.env}, timeout=180)
        print(f"[e2e] doctor:\n{doctor.stdout}")
        assert doctor.returncode == 0 and doctor.stdout.rstrip().endswith("verdict: healthy"), \
            doctor.stdout + doctor.stderr[-3000:]

        # 3. cut the A-B link while the long prompt's KV is crossing a slowed link. The long
        # prompt's KV is 640 tokens x 2 KiB = 1.3 MB: ~40 s at 256 kbit/s, five times the
        # transfer deadline, so the load cannot end before the cut however late this test sees
        # the request arrive (at 2 mbit/s it took ~5 s and once finished first on a busy box).
        r = subprocess.run(["ip", "netns", "exec", ns_a, "tc", "qdisc", "add", "dev", dev_a, "root", "tbf",
                            "rate", "256kbit", "burst", "32kb", "latency", "400ms"], capture_output=True, text=True)
        _must(r, "slow the A-B link with tc")
        kv = _prefill_hop(prefill, long_prompt)  # its KV waits on the prefill engine
        ext0, loc0 = _prompt_tokens(decode)
        seen0 = _requests_seen(decode)

        async def cut() -> tuple[float, object]:
            task = asyncio.create_task(_decode_with(decode, long_prompt, kv))
            await _until("the decode engine took the long prompt", lambda: _requests_seen(decode) > seen0, [task])
            assert ip("link", "set", dev_a, "down", ns=ns_a).returncode == 0
            return await task

        _, resp = asyncio.run(asyncio.wait_for(cut(), timeout=TRANSFER_TIMEOUT_S * 4 + 120))
        ext1, loc1 = _prompt_tokens(decode)
        assert not isinstance(resp, BaseException), f"recompute policy: the request must be served, got {resp!r}"
        assert prompts.completion_ids(resp) == baseline[tuple(long_prompt)], "recomputed output differs"
        assert ext1 - ext0 == 0, (f"{ext1 - ext0} prompt tokens came from the load: it ended before the cut "
                                  "(the link was not slowed?)")
        assert loc1 - loc0 == len(long_prompt), (loc0, loc1)
        # the decode engine's own account: its READ was in flight and failed (not a refusal up front)
        assert "failed: read from producer rank 0 failed" in decode.log_path.read_text(errors="replace"), \
            "the decode engine logged no failed READ: the load did not fail in flight"

        # 4. link restored: both engines serve again, KV loaded remotely again, nothing held
        assert ip("link", "set", dev_a, "up", ns=ns_a).returncode == 0
        subprocess.run(["ip", "netns", "exec", ns_a, "tc", "qdisc", "del", "dev", dev_a, "root"], capture_output=True)
        after = prompts.after_kill_prompts(vocab_size, seed) + prompts.kill_prompts(vocab_size, seed)[:2]
        rows = _check_answers(client, after, baseline, decode)
        print(f"[e2e] two hosts after the cut: {rows}")
        wait_idle(decode, timeout_s=TRANSFER_TIMEOUT_S + 30)
        wait_idle(prefill, timeout_s=LEASE_S + 30)  # the cut request's hold: released or its lease lapsed
        assert prefill.alive and decode.alive
    finally:
        for s in procs:
            s.stop()
            _LIVE.remove(s)
