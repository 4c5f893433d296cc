"""The side-channel address an engine advertises when none is configured (issue 17, point 4).

Before, an engine without ``side_channel_host`` and without ``VLLM_HOST_IP`` advertised
127.0.0.1: a decode engine on another host could never reach it. Now it advertises the
address of the interface behind its default route (the kernel's own choice, as vLLM's
get_ip() finds it), IPv4 first then IPv6; on a host with nothing but loopback, 127.0.0.1;
on a networked host without a default route it refuses to start, naming the setting.

The routing cases run in fresh network namespaces (``unshare -n``) with dummy interfaces
and real routes, so the kernel's routing table decides, not a patched function. The last
tests run real connector workers with no host configured: the address a consumer is
given must be routable and a load over it must bring the producer's bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtransport.auth import Authenticator
from kvtransport_vllm.config import AUTH_CHANNEL, ConnectorConfig, ConnectorConfigError, routable_host

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"side-channel-host-test-secret-0123"


def _cfg(extra: dict | None = None) -> ConnectorConfig:
    return ConnectorConfig.from_extra("kv_producer", "e", {"side_channel_auth": "off", **(extra or {})})


def test_given_host_is_advertised_and_listened_on_as_given(monkeypatch):
    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")
    cfg = _cfg({"side_channel_host": "127.0.0.1"})
    assert (cfg.side_channel_host, cfg.side_channel_bind_host, cfg.side_channel_host_auto) == \
        ("127.0.0.1", "127.0.0.1", False)


def test_vllm_host_ip_is_the_operators_choice(monkeypatch):
    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")
    cfg = _cfg()
    assert (cfg.side_channel_host, cfg.side_channel_bind_host, cfg.side_channel_host_auto) == \
        ("10.1.2.3", "10.1.2.3", False)


def test_side_channel_host_of_the_wrong_type_is_refused_by_name():
    with pytest.raises(ConnectorConfigError, match="side_channel_host must be a host name or address"):
        _cfg({"side_channel_host": 5})


def _kernel_route_source() -> str | None:
    """What ``ip route get`` says the source address towards a public address is."""
    if shutil.which("ip") is None:
        return None
    for args in (["ip", "route", "get", "8.8.8.8"], ["ip", "-6", "route", "get", "2001:4860:4860::8888"]):
        out = subprocess.run(args, capture_output=True, text=True)
        words = out.stdout.split()
        if out.returncode == 0 and "src" in words:
            return words[words.index("src") + 1]
    return None


def test_default_is_the_default_routes_address_and_listens_everywhere(monkeypatch):
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    src = _kernel_route_source()
    if src is None:
        pytest.skip("this host has no default route (or no `ip` tool): the namespace tests below cover it")
    cfg = _cfg()
    assert cfg.side_channel_host == src == routable_host()
    assert cfg.side_channel_host not in ("127.0.0.1", "::1")
    assert cfg.side_channel_host_auto
    assert cfg.side_channel_bind_host == ("::" if ":" in src else "0.0.0.0")


# ----------------------------------------------------------------------------- namespaces
_PROBE = """
import json, os
os.environ.pop("VLLM_HOST_IP", None)
from kvtransport_vllm.config import ConnectorConfig, ConnectorConfigError
try:
    c = ConnectorConfig.from_extra("kv_producer", "e", {"side_channel_auth": "off"})
    print(json.dumps({"host": c.side_channel_host, "bind": c.side_channel_bind_host}))
except ConnectorConfigError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def _in_fresh_netns(setup: list[str]) -> dict:
    """Run the probe in a new network namespace after ``setup`` (ip commands)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare(1) and ip(8) to build a network namespace")
    script = " && ".join(["ip link set lo up", *setup, f"exec {sys.executable} -c \"$PROBE\""])
    env = dict(os.environ, PROBE=_PROBE,
               PYTHONPATH=os.pathsep.join(str(ROOT / d) for d in ("", "backends", "vllm_adapter", "tools")))
    r = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    if r.returncode != 0 and ("Operation not permitted" in r.stderr or "unshare failed" in r.stderr):
        pytest.skip(f"network namespaces are not permitted here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


#: a veth pair inside the namespace (its far end there too): an up interface that routes
_VETH = ["ip link add d0 type veth peer name e0", "ip link set d0 up", "ip link set e0 up"]


def test_loopback_only_host_advertises_loopback():
    """No interface but lo: no other host exists to reach us, 127.0.0.1 is right."""
    assert _in_fresh_netns([]) == {"host": "127.0.0.1", "bind": "0.0.0.0"}


def test_ipv4_default_route_gives_that_interfaces_address():
    got = _in_fresh_netns([*_VETH, "ip addr add 10.77.0.2/24 dev d0", "ip route add default via 10.77.0.1 dev d0"])
    assert got == {"host": "10.77.0.2", "bind": "0.0.0.0"}


def test_ipv6_only_host_gives_its_ipv6_address():
    got = _in_fresh_netns([*_VETH, "ip -6 addr add fd77::2/64 dev d0 nodad", "ip -6 route add default via fd77::1 dev d0"])
    assert got == {"host": "fd77::2", "bind": "::"}


def test_networked_host_without_default_route_refuses_naming_the_setting():
    """Two networks and no default route: a guess could be the wrong network, so refuse."""
    got = _in_fresh_netns([*_VETH, "ip addr add 10.77.0.2/24 dev d0", "ip addr add 10.78.0.2/24 dev e0"])
    assert "error" in got, got
    assert "side_channel_host" in got["error"] and "VLLM_HOST_IP" in got["error"]


# ----------------------------------------------------------------------------- real servers
def test_chosen_address_server_answers_on_loopback_and_on_the_advertised_address(monkeypatch):
    """What the worker's server does with a chosen address: listen on every interface, so
    a peer on this host (127.0.0.1) and a remote one (the advertised address) both get an
    authenticated answer."""
    from harness import free_port_base

    from kvtransport_vllm.messages import Renew, Reply
    from kvtransport_vllm.side_channel import SideChannelClient, SideChannelServer

    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    cfg = _cfg()
    if cfg.side_channel_host == "127.0.0.1":
        pytest.skip("this host has only loopback: there is no second address to reach")
    port = free_port_base(1)
    auth = Authenticator(SECRET, AUTH_CHANNEL)
    server = SideChannelServer(cfg.side_channel_host, port, lambda m: Reply(status={k: "ok" for k in m.keys}),
                               auth=auth, bind_host=cfg.side_channel_bind_host)
    try:
        for host in ("127.0.0.1", cfg.side_channel_host):
            client = SideChannelClient(host, port, auth=Authenticator(SECRET, AUTH_CHANNEL))
            try:
                cid = client.send(Renew(keys=[host]))
                end = time.monotonic() + 20.0  # a hang guard, not a timing bound
                replies: list = []
                while not replies:
                    replies = [r for r in client.poll() if r.cid == cid]
                    assert time.monotonic() < end, f"no answer at {host}:{port}"
                    time.sleep(0.005)
                assert replies[0].status == {host: "ok"}
            finally:
                client.close()
    finally:
        server.close()


def test_worker_with_no_host_configured_serves_a_load_over_its_routable_address(pairs, monkeypatch):
    """Real producer and consumer workers, neither given a host: the consumer is told the
    producer's routable address, loads over it, and gets the producer's bytes."""
    from harness import finish_reason, prompt_of

    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    expected = routable_host() or "127.0.0.1"
    pair = pairs("read")
    assert pair.P.worker._worker.cfg.side_channel_host == expected
    prompt = prompt_of(50)
    params = pair.prefill("p1", prompt)
    assert params["remote_host"] == expected
    pair.C.add("c1", prompt, 2, params)
    seen = pair.run_to_end_checking_kv("c1", prompt)
    assert seen == [[]], "the consumer never ran with the whole prompt loaded, or some block differs"
    assert finish_reason(pair.C, "c1") == "length"
    assert pair.C.first_start["c1"] >= len(prompt) - 1, "the KV was recomputed, not loaded"
    pair.drain()
    pair.assert_no_leak()


def test_worker_with_no_host_configured_listens_on_loopback_too(pairs, monkeypatch):
    """Peers on the same host that address it as 127.0.0.1 (as every one did while that
    was the default) still reach a worker whose address was chosen for it. Needs the
    worker to listen on ``cfg.side_channel_bind_host``."""
    from kvtransport_vllm.messages import Renew, Reply
    from kvtransport_vllm.side_channel import SideChannelClient

    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    pair = pairs("read")
    pw = pair.P.worker._worker
    client = SideChannelClient("127.0.0.1", pair.p_port, auth=pw.cfg.make_authenticator())
    try:
        cid = client.send(Renew(keys=["nobody"]))
        end = time.monotonic() + 20.0  # a hang guard, not a timing bound
        replies: list = []
        while not replies and time.monotonic() < end:
            replies = [r for r in client.poll() if r.cid == cid]
            time.sleep(0.005)
        assert replies and isinstance(replies[0], Reply), (
            f"the worker does not answer on 127.0.0.1:{pair.p_port}; it must listen on "
            f"side_channel_bind_host ({pw.cfg.side_channel_bind_host})")
    finally:
        client.close()
