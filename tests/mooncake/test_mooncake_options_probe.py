"""What a user of ``backend: mooncake`` sees when something is wrong: bad options refused with
a typed error naming the fix, peers with other protocols or malformed blobs refused, and the
precise reason (and install hint) when the backend cannot run -- package missing, system verbs
library missing (a real loader failure, in a mount namespace), engine that cannot initialise
(a real one: no free port in the allowed range) -- also in ``kvtransport backends``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import msgspec
import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport.process_identity import ProcessIdentity
from kvtransport.testing.required import skip_unless_usable

CLI = [sys.executable, "-m", "kvtransport.cli", "backends", "--json"]


@pytest.mark.parametrize("options, words", [
    ({"bogus": 1}, ["unknown option(s) ['bogus']", "protocol", "device_name", "hostname"]),
    ({"protocol": "udp"}, ["protocol must be one of ['tcp', 'rdma']"]),
    ({"hostname": "127.0.0.1:9000"}, ["hostname must be an IP address or host name", "no port"]),
    ({"device_name": "mlx5_0;rm"}, ["device_name must be a comma-separated list"]),
    ({"chunk_segments": 2048}, ["chunk_segments (2048) must not exceed max_inflight_segments (1024)"]),
    ({"max_inflight_segments": 0}, ["max_inflight_segments must be an integer from 1"]),
    ({"chunk_segments": True}, ["chunk_segments must be an integer"]),
    ({"liveness_interval_s": -1}, ["liveness_interval_s must be a number > 0"]),
])
def test_bad_options_refused_with_a_typed_error(options, words):
    with pytest.raises(errors.BackendOptionError) as ei:
        kvt.open("mooncake", name="bad", **options)
    for w in words:
        assert w in str(ei.value)


def test_rdma_without_a_device_is_refused_with_the_reason():
    skip_unless_usable("mooncake")
    from kvtransport_mooncake import probe

    if probe.rdma_devices(probe.load_engine_module(), ""):
        pytest.skip("this host has an RDMA device; the refusal is for hosts without one")
    with pytest.raises(errors.BackendUnavailableError) as ei:
        kvt.open("mooncake", name="rdma", protocol="rdma")
    assert "finds no RDMA device" in str(ei.value) and "protocol='tcp'" in str(ei.value)


def test_peer_blobs_decoded_strictly():
    skip_unless_usable("mooncake")
    from kvtransport_mooncake import wire

    with kvt.open("mooncake", name="wire-a") as a:
        blob = a._backend.export()
        exp = wire.decode("a", blob, "tcp")
        assert exp.session.startswith("127.0.0.1:")
        key = exp.notify_key
        with pytest.raises(errors.IncompatiblePeerError, match="protocol 'tcp'.*'rdma'"):
            wire.decode("a", blob, "rdma")
        ident = ProcessIdentity(1, 1, "", "")

        def blob_of(session, scratch, key, v=2):
            body = wire.CODEC.seal(ident, session=session, protocol="tcp", scratch_addr=scratch, notify_key=key)
            return wire.CODEC.encode(msgspec.structs.replace(body, v=v))

        bad = [b"", blob[:-3], blob + b"\x00",
               blob_of(exp.session, 8, key, v=1),
               blob_of("no-port", 8, key),
               blob_of("h:70000", 8, key),
               blob_of(exp.session, 0, key),
               blob_of(exp.session, 8, b"short-key")]
        assert wire.decode("a", blob_of(exp.session, 8, key), "tcp").scratch_addr == 8  # the helper builds good ones
        for b in bad:
            with pytest.raises(errors.PeerMetadataError):
                wire.decode("a", b, "tcp")


def test_probe_reason_when_the_package_is_missing(monkeypatch):
    from kvtransport_mooncake import probe

    real = probe.importlib.util.find_spec
    monkeypatch.setattr(probe.importlib.util, "find_spec", lambda n, *a: None if n == "mooncake" else real(n, *a))
    av = probe.probe.__wrapped__()
    assert not av.usable and "'mooncake'" in av.reason and "not installed" in av.reason
    assert "pip install 'kvtransport[mooncake]'" in av.install_hint


def _free_port_outside_ephemeral_range() -> socket.socket:
    """A listening socket on a port Mooncake accepts as an RPC port range bound (< 32768)."""
    for port in range(21000, 32000, 13):
        s = socket.socket()
        try:
            s.bind(("0.0.0.0", port))
            s.listen()
            return s
        except OSError:
            s.close()
    pytest.skip("no free port in 21000..32000")


def test_probe_reason_when_the_engine_cannot_initialise():
    """Real failure: the only port Mooncake may bind (MC_MIN/MAX_RPC_PORT) is taken."""
    skip_unless_usable("mooncake")
    held = _free_port_outside_ephemeral_range()
    port = held.getsockname()[1]
    env = dict(os.environ, MC_MIN_RPC_PORT=str(port), MC_MAX_RPC_PORT=str(port))
    try:
        out = subprocess.run(CLI, capture_output=True, text=True, timeout=300, env=env, check=True)
    finally:
        held.close()
    row = {r["name"]: r for r in json.loads(out.stdout)}["mooncake"]
    assert row["usable"] is False
    assert "does not initialise" in row["reason"] and "MC_MIN_RPC_PORT" in row["reason"]


def _can_unshare_mounts() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


@pytest.mark.parametrize("soname, package", [("libibverbs.so.1", "libibverbs1"), ("libnuma.so.1", "libnuma1")])
def test_cli_reason_and_hint_when_a_system_library_is_missing(soname, package):
    """Real loader failure: the library replaced by an empty file in a private mount
    namespace; ``kvtransport backends`` names the library and the apt package."""
    skip_unless_usable("mooncake")
    if not _can_unshare_mounts():
        pytest.skip(f"needs root and mount namespaces (unshare -m) to hide {soname} from the loader")
    lib = subprocess.run(["sh", "-c", f"ldconfig -p | awk '/{soname} /{{print $NF; exit}}'"],
                         capture_output=True, text=True).stdout.strip()
    if not lib:
        pytest.skip(f"{soname} is not in the loader cache")
    script = f"mount --bind /dev/null {os.path.realpath(lib)} && exec {' '.join(CLI)}"
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["mooncake"]["usable"] is False
    assert soname in rows["mooncake"]["reason"]
    assert rows["mooncake"]["install_hint"].startswith(f"apt-get install {package} ")
    assert rows["loopback"]["usable"] is True  # one backend's missing library hides no other


def test_cli_lists_mooncake_usable_here():
    skip_unless_usable("mooncake")
    out = subprocess.run(CLI, capture_output=True, text=True, timeout=300, check=True)
    row = {r["name"]: r for r in json.loads(out.stdout)}["mooncake"]
    assert row["usable"] is True and row["entry_point"] == "kvtransport_mooncake.backend:MooncakeBackend"
