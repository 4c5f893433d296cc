"""``kvtransport doctor``: is this prefill / decode pair able to move KV, and if not, why?

Given the two engines' side-channel addresses and the cluster secret, the doctor checks,
for every TP rank, what a real load needs, in the order a load needs it, and prints each
finding with the fix:

1. **reach** — a TCP connection to ``host:port`` (base port + TP rank). Refused: nothing
   listens there. No answer: a firewall drops it, or the address is wrong.
2. **side channel** — a sealed ``Probe`` answered with a sealed ``ProbeInfo`` (the data a
   consumer's hand-shake gets: engine id, role, mode, backend, agent metadata, KV
   layout). An unsealed refusal means the secrets differ.
3. **compatibility** — roles, mode, backend and backend version, and the KV layout
   (model, dtypes, block size, layers, head geometry, attention layout, and whether the two
   TP sizes map onto each other), with the hand-shake's own check (:mod:`.compat`). The
   engines may have different TP sizes: each engine's ranks are found from its rank 0's
   TP size and each is checked on its own.
4. **data path, both ways** — the doctor opens its own agent with the engines' backend and
   registers its own scratch memory. It READs one block from each engine (the consumer's
   direction in READ mode), then asks the engine (``ProbeWrite``) to WRITE the same block
   into the scratch memory (the producer's direction in WRITE mode), and compares the two
   copies byte for byte. Nothing is ever written into an engine: its KV cache is only
   read. Block 0 is the default (vLLM's reserved null block, which no request uses).

Why a third party rather than a test between the two engines: the doctor needs no change
to a serving engine's state, and every check it makes is one a real load makes too, so a
pair the doctor calls healthy has passed the same gates a request will.
"""

from __future__ import annotations

import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvtransport as kvt
from kvtransport.auth import AuthConfigError, AuthError, Authenticator, load_secret
from kvtransport.metadata import decode_metadata

from .compat import refusal
from .config import AUTH_CHANNEL
from .kv_layout import block_segments, remote_layouts
from .messages import (
    DOCTOR_AGENT_PREFIX,
    Error,
    LayoutInfo,
    Msg,
    Probe,
    ProbeInfo,
    ProbeResult,
    ProbeStatus,
    ProbeWrite,
    decode,
)
from .side_channel import SideChannelClient

__all__ = ["Finding", "Verdict", "DoctorUsageError", "run_doctor", "parse_address", "doctor_secret", "main"]

FIX_SECRET = ("give the doctor the engines' cluster secret: the same KVTRANSPORT_SECRET, KVTRANSPORT_SECRET_FILE "
              "or side_channel_secret the engines use (doctor: --secret-file PATH or the environment)")
FIX_PORT = ("start the engine with kv_connector KVTransportConnector, or fix the address: the side channel listens "
            "on side_channel_host at side_channel_port + DP rank x TP size + TP rank (the engine logs 'side channel HOST:PORT' at start)")
FIX_FIREWALL = ("open TCP side_channel_port .. side_channel_port + DP size x TP size - 1 between the hosts (see docs/DEPLOY.md), "
                "or use the address the engine advertises (side_channel_host / VLLM_HOST_IP)")
FIX_ADDRESS = ("address the engine as it advertises itself: its side_channel_host and side_channel_port (+ rank), the "
               "remote_host / remote_port its kv_transfer_params name; a port forward or another host name is refused")
FIX_LAYOUT = ("serve the same model with the same dtype on both engines, with block sizes that divide one another "
              "and TP sizes that split the KV heads evenly (the message names each difference)")
FIX_BACKEND = ("set the same kv_connector_extra_config backend (and backend_options) on both engines and install "
               "the same kvtransport release on each")
FIX_BACKEND_HERE = ("install the backend on the doctor's host (`kvtransport backends` says why it cannot run), run "
                    "the doctor on an engine host, or pass the engines' backend_options with --backend-options")
FIX_DATA_PATH = ("the side channel works but the backend's data path does not: open the backend's data ports between "
                 "the hosts (UCX over TCP: see docs/DEPLOY.md) and use the same backend_options (e.g. UCX tls) everywhere")


class DoctorUsageError(ValueError):
    """The doctor was called wrongly (bad address, no secret); the message says how to call it."""


@dataclass
class Finding:
    """One check's outcome: which engine (or the pair), what was found, and the fix."""

    check: str  # reach | auth | side_channel | compat | layout | backend | read | write | bytes
    subject: str
    ok: bool
    message: str
    fix: str = ""


@dataclass
class Verdict:
    findings: list[Finding] = field(default_factory=list)
    #: per engine ("prefill rank 0", ...): the block's bytes, when the READ copy and the
    #: engine's WRITE copy were identical
    moved: dict[str, bytes] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return bool(self.findings) and all(f.ok for f in self.findings)

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if not f.ok]

    @property
    def exit_code(self) -> int:
        """0 healthy, 1 at least one problem found."""
        return 0 if self.healthy else 1

    def render(self) -> str:
        lines = []
        for f in self.findings:
            lines.append(f"{'ok  ' if f.ok else 'FAIL'}  [{f.check}] {f.subject}: {f.message}")
            if f.fix:
                lines.append(f"      fix: {f.fix}")
        if self.healthy:
            lines.append("verdict: healthy")
        else:
            lines.append(f"verdict: {len(self.problems)} problem(s): "
                         + ", ".join(sorted({p.check for p in self.problems})))
        return "\n".join(lines)

    def add(self, *args: Any, **kwargs: Any) -> Finding:
        f = Finding(*args, **kwargs)
        self.findings.append(f)
        return f


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); DoctorUsageError otherwise."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DoctorUsageError(f"{text!r} is not HOST:PORT (the engine's side_channel_host and side_channel_port)")
    return host, int(port)


def doctor_secret(secret_file: str | None = None) -> bytes | None:
    """The cluster secret from ``secret_file``, else as the connector finds it
    (KVTRANSPORT_SECRET, KVTRANSPORT_SECRET_FILE; None only with KVTRANSPORT_AUTH=off)."""
    try:
        if secret_file:
            with open(secret_file, "rb") as f:
                return load_secret(f.read().strip())
        return load_secret(None)
    except (AuthConfigError, OSError) as exc:
        raise DoctorUsageError(f"cluster secret: {exc}") from None


class _DoctorClient(SideChannelClient):
    """A side-channel client that keeps the engine's unsealed refusal (the hint a normal
    client only logs), so the verdict can name it; the hint is reported, never trusted."""

    refusal: str = ""

    def _unauthentic(self, frame: bytes, exc: AuthError) -> None:
        super()._unauthentic(frame, exc)
        try:
            msg = decode(frame)
        except Exception:  # not even a message: keep the authentication error itself
            self.refusal = self.refusal or str(exc)
            return
        if isinstance(msg, Error):
            self.refusal = f"{msg.code}: {msg.message[:300]}"

    def ask(self, msg: Msg, timeout_s: float) -> Msg | None:
        """Send ``msg``, wait for its reply (None if none within ``timeout_s``)."""
        cid = self.send(msg)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for reply in self.poll():
                if reply.cid == cid:
                    return reply
                if isinstance(reply, Error) and reply.cid == 0:  # a refusal of a request it could not read
                    self.refusal = f"{reply.code}: {reply.message[:300]}"
            if self.refusal:
                return None
            time.sleep(0.005)
        return None


def _reach(v: Verdict, who: str, host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        v.add("reach", who, False, f"port closed: nothing listens on {host}:{port}", FIX_PORT)
    except (socket.timeout, TimeoutError):
        v.add("reach", who, False, f"no answer from {host}:{port} within {timeout_s:g}s (filtered?)", FIX_FIREWALL)
    except OSError as exc:
        v.add("reach", who, False, f"cannot reach {host}:{port}: {exc}", FIX_FIREWALL)
    return False


def _probe(v: Verdict, who: str, host: str, port: int, auth: Authenticator | None,
           timeout_s: float) -> ProbeInfo | None:
    """Reach the engine and get its ProbeInfo, adding a finding for whatever fails."""
    if not _reach(v, who, host, port, timeout_s):
        return None
    client = _DoctorClient(host, port, auth=auth)
    try:
        reply = client.ask(Probe(doctor="kvtransport-doctor"), timeout_s)
    finally:
        client.close()
    if isinstance(reply, ProbeInfo):
        v.add("side_channel", who, True, f"{host}:{port} is {reply.engine_id} ({reply.kv_role}, {reply.mode} mode, "
              f"{reply.backend} backend); authenticated")
        return reply
    # an unsealed refusal (client.refusal), or a plain Error when the doctor seals nothing
    said = client.refusal or (f"{reply.code}: {reply.message[:300]}" if isinstance(reply, Error) else "")
    code = said.split(":", 1)[0]
    if code == "auth" and auth is None:
        v.add("auth", who, False, f"{host}:{port} requires sealed messages and the doctor runs with "
              f"KVTRANSPORT_AUTH=off ({said})", FIX_SECRET)
    elif code == "auth" and "misdirected" in said:
        # sealed with the right secret, for a name the engine does not answer to (a port
        # forward, another host name): the secret is fine, the address is not
        v.add("side_channel", who, False, f"{host}:{port} is not the name this engine advertises ({said})",
              FIX_ADDRESS)
    elif code == "auth":
        v.add("auth", who, False, f"wrong secret: {host}:{port} refused the doctor's request ({said})", FIX_SECRET)
    elif code == "malformed" and client.refusal:
        v.add("auth", who, False, f"{host}:{port} could not read the doctor's sealed request: the engine runs "
              f"with side_channel_auth off ({said})", "turn authentication on for every engine (a cluster secret; "
              "recommended), or run the doctor with KVTRANSPORT_AUTH=off")
    elif code == "version":
        v.add("side_channel", who, False, f"{host}:{port} speaks another side-channel protocol version ({said})",
              "run the same kvtransport release on the engines and the doctor")
    elif isinstance(reply, Error) and reply.code == "unexpected":
        v.add("side_channel", who, False, f"{host}:{port} runs a kvtransport without the doctor's messages",
              "upgrade both engines to this kvtransport release")
    elif isinstance(reply, Error):
        v.add("side_channel", who, False, f"{host}:{port} answered {reply.code}: {reply.message}",
              "wait until the engine has started (it registers its KV cache at start-up)"
              if reply.code == "not_ready" else "")
    else:
        v.add("side_channel", who, False, f"{host}:{port} accepts TCP but gave no kvtransport answer within "
              f"{timeout_s:g}s (another service on that port, or authentication off on one side only)",
              f"{FIX_PORT}; and {FIX_SECRET}")
    return None


def _compare(v: Verdict, pre: ProbeInfo, dec: ProbeInfo) -> bool:
    """Roles, mode, backend and layout, as the hand-shake compares them (rank 0 of each
    engine: every rank of an engine shares its layout but for its own memory)."""
    subject, ok = "pair", True
    if pre.kv_role not in ("kv_producer", "kv_both") or dec.kv_role not in ("kv_consumer", "kv_both"):
        ok = False
        v.add("compat", subject, False, f"roles: prefill is {pre.kv_role}, decode is {dec.kv_role}",
              "give the prefill engine kv_role kv_producer and the decode engine kv_consumer (or kv_both), "
              "and pass the addresses in that order")
    if pre.mode != dec.mode:
        ok = False
        v.add("compat", subject, False, f"mode: prefill {pre.mode}, decode {dec.mode}",
              "set the same mode (read or write) on both engines")
    if pre.backend != dec.backend:
        ok = False
        v.add("backend", subject, False, f"backends differ: prefill {pre.backend}, decode {dec.backend}", FIX_BACKEND)
    else:
        pv, dv = decode_metadata(pre.agent_md).backend_version, decode_metadata(dec.agent_md).backend_version
        if pv != dv:
            ok = False
            v.add("backend", subject, False, f"{pre.backend} backend versions differ: {pv} vs {dv}", FIX_BACKEND)
    diff = refusal(pre.layout, dec.layout, "prefill", "decode")
    if diff:
        ok = False
        v.add("layout", subject, False, f"layout mismatch: {diff}", FIX_LAYOUT)
    if ok:
        lay = pre.layout
        v.add("compat", subject, True, f"same {pre.backend} backend, {pre.mode} mode, prefill TP {lay.tp_size} -> "
              f"decode TP {dec.layout.tp_size}, layout: {lay.num_layers} layers "
              f"x {lay.parts_per_layer} part(s) x {lay.block_bytes} B, block size {lay.block_size}, {lay.dtype}")
    return ok


def _packed_offsets(lengths: np.ndarray) -> np.ndarray:
    """Offsets that lay ranges of ``lengths`` end to end from 0 (the scratch layout; the
    engine's probe write uses the same order)."""
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)


def _block_bytes(layout: LayoutInfo) -> int:
    return layout.num_layers * layout.parts_per_layer * layout.block_bytes


def _move_block(v: Verdict, who: str, host: str, port: int, info: ProbeInfo, auth: Authenticator | None,
                backend_options: dict[str, Any], block_id: int, timeout_s: float) -> None:
    """READ one block from the engine, have the engine WRITE it to us; compare the copies."""
    n = _block_bytes(info.layout)
    try:
        agent = kvt.open(info.backend, name=f"{DOCTOR_AGENT_PREFIX}{uuid.uuid4().hex[:12]}",
                         default_timeout_s=timeout_s, **backend_options)
    except kvt.errors.KVTransportError as exc:
        v.add("backend", who, False, f"cannot open a {info.backend} agent on the doctor's host: {exc}",
              FIX_BACKEND_HERE)
        return
    try:
        rng = np.random.default_rng()
        scratch = rng.integers(0, 256, 2 * n, dtype=np.uint8)  # two different random halves
        try:  # registering needs the backend's devices too (UCX: a NIC without carrier is refused)
            region = agent.register(scratch)
            peer = agent.connect(info.agent_md)
            layouts = remote_layouts(peer, info.layout)
        except kvt.errors.KVTransportError as exc:
            v.add("backend", who, False, f"the doctor's {info.backend} agent cannot use {info.engine_id}'s: {exc}",
                  FIX_BACKEND_HERE)
            return
        have = min(lay.num_blocks for lay in layouts)
        if block_id >= have:
            v.add("read", who, False, f"{info.engine_id} has no block {block_id} (it has {have})",
                  f"pass --block below {have}")
            return
        remote = block_segments(layouts, [block_id])
        local = region.segments(_packed_offsets(remote.length), remote.length)
        st = agent.read(peer, local, remote, timeout=timeout_s).wait()
        if st.state is not kvt.State.DONE:
            v.add("read", who, False, f"READ of block {block_id} from {info.engine_id} failed: {st.reason}",
                  FIX_DATA_PATH)
        else:
            v.add("read", who, True, f"READ {n} bytes of block {block_id} from {info.engine_id}")
        _engine_write(v, who, host, port, info, auth, agent, region.id, n, block_id, timeout_s)
        if v.findings[-1].ok and st.state is kvt.State.DONE:
            same = bool(np.array_equal(scratch[:n], scratch[n:]))
            if same:
                v.moved[who] = scratch[:n].tobytes()
            v.add("bytes", who, same, "the block READ and the block the engine WROTE are identical" if same else
                  f"the block READ and the block the engine WROTE differ in {int(np.sum(scratch[:n] != scratch[n:]))}"
                  " bytes", "" if same else "block 0 may have changed in between: retry with --block; if it "
                  "persists, report it with `kvtransport backends` output from both hosts")
    finally:
        agent.close()


def _engine_write(v: Verdict, who: str, host: str, port: int, info: ProbeInfo, auth: Authenticator | None,
                  agent: Any, region_id: int, offset: int, block_id: int, timeout_s: float) -> None:
    client = _DoctorClient(host, port, auth=auth)
    try:
        r = client.ask(ProbeWrite(agent_md=agent.metadata(), block_id=block_id, region_id=region_id, offset=offset),
                       timeout_s)
        end = time.monotonic() + timeout_s
        while isinstance(r, ProbeResult) and r.state in ("posted", "pending") and time.monotonic() < end:
            time.sleep(0.01)
            r = client.ask(ProbeStatus(doctor=agent.name), timeout_s)
    finally:
        client.close()
    if isinstance(r, ProbeResult) and r.state == "done":
        v.add("write", who, True, f"{info.engine_id} WROTE block {block_id} into the doctor's memory")
    elif isinstance(r, ProbeResult):
        v.add("write", who, False, f"{info.engine_id}'s WRITE into the doctor's memory: {r.state} {r.detail}".strip(),
              FIX_DATA_PATH)
    else:
        v.add("write", who, False, f"{info.engine_id} did not answer the write probe within {timeout_s:g}s",
              FIX_DATA_PATH)


def run_doctor(prefill: tuple[str, int], decode_: tuple[str, int], secret: bytes | None, *,
               backend_options: dict[str, Any] | None = None, block_id: int = 0,
               timeout_s: float = 10.0) -> Verdict:
    """Check a prefill/decode pair at their side-channel base addresses; see the module doc."""
    v = Verdict()
    auth = Authenticator(secret, AUTH_CHANNEL) if secret is not None else None
    opts = dict(backend_options or {})
    ends = {"prefill": prefill, "decode": decode_}
    # Rank 0 of each engine first: its layout says how many TP ranks the engine has (rank r
    # listens on its base port + r); the two engines may have different TP sizes.
    infos: dict[str, dict[int, ProbeInfo]] = {}
    for role, (host, base) in ends.items():
        first = _probe(v, f"{role} rank 0", host, base, auth, timeout_s)
        infos[role] = {0: first} if first is not None else {}
    for role, (host, base) in ends.items():
        if not infos[role]:
            continue
        for rank in range(1, max(1, infos[role][0].layout.tp_size)):
            info = _probe(v, f"{role} rank {rank}", host, base + rank, auth, timeout_s)
            if info is not None:
                infos[role][rank] = info
        for rank, info in infos[role].items():  # each rank's data path on its own
            _move_block(v, f"{role} rank {rank}", host, base + rank, info, auth, opts, block_id, timeout_s)
    if infos["prefill"] and infos["decode"]:
        _compare(v, infos["prefill"][0], infos["decode"][0])
    return v


def main(argv: list[str] | None = None) -> int:
    """``kvtransport doctor PREFILL_HOST:PORT DECODE_HOST:PORT``: 0 healthy, 1 problems, 2 usage."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="kvtransport doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("prefill", help="prefill engine's side channel, HOST:PORT (side_channel_host:side_channel_port)")
    p.add_argument("decode", help="decode engine's side channel, HOST:PORT")
    p.add_argument("--secret-file", default=None,
                   help="file holding the cluster secret (default: KVTRANSPORT_SECRET / KVTRANSPORT_SECRET_FILE)")
    p.add_argument("--backend-options", default=None, metavar="JSON",
                   help="options for the doctor's own agent, as the engines' backend_options (e.g. '{\"tls\": \"tcp\"}')")
    p.add_argument("--block", type=int, default=0, help="block id moved both ways (default 0: vLLM's null block)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds allowed for each step")
    args = p.parse_args(argv)
    try:
        pre, dec = parse_address(args.prefill), parse_address(args.decode)
        secret = doctor_secret(args.secret_file)
        try:
            opts = json.loads(args.backend_options) if args.backend_options else {}
        except ValueError as exc:
            raise DoctorUsageError(f"--backend-options is not JSON: {exc}") from None
        if not isinstance(opts, dict) or args.block < 0 or args.timeout <= 0:
            raise DoctorUsageError("--backend-options must be a JSON object, --block >= 0 and --timeout > 0")
    except DoctorUsageError as exc:
        print(f"kvtransport doctor: error: {exc}", flush=True)
        return 2
    verdict = run_doctor(pre, dec, secret, backend_options=opts, block_id=args.block, timeout_s=args.timeout)
    print(verdict.render(), flush=True)
    return verdict.exit_code
