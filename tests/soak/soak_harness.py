"""Soak harness: a real vLLM Scheduler pair driven step by step for thousands of requests
under injected faults, with the lifecycle invariants checked after every step.

Topology: a consumer :class:`harness.Engine` (real ``Scheduler`` + connector worker) in this
process; the producer either in this process too (:class:`LocalProducer`) or in a child
process (:class:`ChildProducer`, ``_soak_producer.py``) that the soak kills with SIGKILL and
restarts on the same port. Bytes move through the real backend (loopback CMA, or ucx).

KV content is the harness's deterministic pattern (a function of token id, position and
layer) and every prompt is random, so the consumer checks every block reported loaded
against the exact bytes the producer computed without asking it.

Faults, all drawn from seeded RNGs:

* core (``kvtransport.FaultPlan`` through ``backend_options["faults"]``, on both agents):
  failed transfers, transfers that never complete, completions delayed past the deadline,
  dropped / duplicated agent notifications (the connector does not use agent notifications;
  its notifications are side-channel messages, faulted below);
* side channel (:class:`SideChannelFaults`, the workers' ``transmit``): requests
  dropped, duplicated as a network replay (same sealed frame twice: the replay guard must
  refuse the copy), duplicated as an application resend (two fresh seals: the handler sees
  it twice), delayed past the producer's lease;
* requests: aborted on the consumer at random moments, aborted on the producer during
  prefill, forwarded to the consumer only after the producer's lease lapsed (the stale-read
  hazard: those blocks may already hold another request's KV), never forwarded (the lease
  must lapse and free the producer's blocks);
* producer process killed (SIGKILL) and restarted on the same address (child mode).

Invariants (checked after every consumer step; any violation is recorded with context):

* I1 no exception escapes into the scheduler (the engine step never raises; no connector
  log record carries a traceback; the side-channel threads stay alive);
* I2 R2 never stranded, as deadline facts of the connector's own loads (no wall-clock
  bound, so CPU contention cannot fail it nor hide a hang): a consumer step that began
  after a load's deadline leaves it in no waiting state -- it is finished, or a failed
  READ waiting for quiescence (T3), or a WRITE give-up waiting for the producer's cancel
  ack -- and a give-up still unacknowledged past deadline + lease + transfer timeout
  (where the consumer must consider the producer gone) has ended too. How long requests
  waited is reported (``max_wait_s``), not asserted; I6 catches one that never ends;
* I3 R1: a request waiting for remote KV is never scheduled before it was reported loaded;
* I4 R3: ``finished_recving`` names a request at most once and only one vLLM tracks;
* I5 every block reported loaded holds the producer's exact bytes; in-process, its key's
  lease ended by confirmation ("done"), never by expiry (stale read);
* I6 R4: at the end both block pools are fully free, nothing pending or unquiesced in
  either agent, no hold or load left in either worker.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VLLM_TESTS = HERE.parent / "vllm"
if str(VLLM_TESTS) not in sys.path:
    sys.path.insert(0, str(VLLM_TESTS))

from harness import Engine, free_port_base  # noqa: E402
import torch  # noqa: E402

from kvtransport_vllm.consumer import RecvState  # noqa: E402
from kvtransport_vllm.side_channel import SideChannelClient  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

WFRK = RequestStatus.WAITING_FOR_REMOTE_KVS


# ----------------------------------------------------------------------------------------
# side-channel faults


class SideChannelFaults:
    """Perturbs every side-channel request sent by the workers it is passed to (as their
    clients' ``transmit``: :class:`kvtransport_vllm.side_channel.Transmit`)."""

    def __init__(self, seed: int, drop: float = 0.0, dup_frame: float = 0.0, dup_msg: float = 0.0,
                 delay: float = 0.0, delay_s: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.rates = {"drop": drop, "dup_frame": dup_frame, "dup_msg": dup_msg, "delay": delay}
        self.delay_s = delay_s
        self.enabled = True
        self.counts: Counter[str] = Counter()
        self._later: list[tuple[float, SideChannelClient, bytes]] = []

    def transmit(self, client: SideChannelClient, body: bytes) -> None:
        if not self.enabled:
            client.send_frame(client.seal(body))
            return
        x = self.rng.random()
        acc = 0.0
        for kind, rate in self.rates.items():
            acc += rate
            if x < acc:
                self.counts[f"sc_{kind}"] += 1
                break
        else:
            kind = "pass"
        if kind == "drop":
            return
        frame = client.seal(body)
        if kind == "delay":
            self._later.append((time.monotonic() + self.delay_s, client, frame))
            return
        client.send_frame(frame)
        if kind == "dup_frame":
            client.send_frame(frame)  # a network-level replay: must be refused by the replay guard
        elif kind == "dup_msg":
            client.send_frame(client.seal(body))  # an application-level resend: handler sees it twice

    def flush(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        due = [x for x in self._later if x[0] <= now]
        if not due:
            return
        self._later = [x for x in self._later if x[0] > now]
        for _, client, frame in due:
            try:
                client.send_frame(frame)
            except Exception:  # the client was closed meanwhile (engine shut down): dropped
                pass


#: load states that must not outlive the load's deadline by a step (I2)
_STILL_WAITING = (RecvState.CONNECT, RecvState.CONFIRM, RecvState.WRITE_WAIT)

# ----------------------------------------------------------------------------------------
# configuration and results


@dataclass
class SoakConfig:
    mode: str = "read"
    requests: int = 500
    seed: int = 1
    backend: str = "loopback"
    backend_options: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 1.0
    lease_s: float = 2.0
    in_flight: int = 24
    min_prompt: int = 8
    max_prompt: int = 160
    block_size: int = 16
    num_blocks: int = 512
    # core faults (FaultPlan); delay_s > timeout_s means "completion delayed past the deadline"
    fail_rate: float = 0.03
    hang_rate: float = 0.02
    delay_rate: float = 0.02
    drop_notify_rate: float = 0.02
    dup_notify_rate: float = 0.02
    # side-channel faults
    sc_drop: float = 0.02
    sc_dup_frame: float = 0.02
    sc_dup_msg: float = 0.02
    sc_delay: float = 0.01
    # request-level faults
    c_abort_rate: float = 0.04
    p_abort_rate: float = 0.02
    late_forward_rate: float = 0.02
    never_forward_rate: float = 0.01
    # child-process producer: kill -9 and restart it after these fractions of the requests,
    # each time once the producer process has served this many loads (verified byte for
    # byte): a restarted producer takes seconds to start while requests queue for it, and a
    # kill on the issue count alone could land before it served anything
    child_producer: bool = False
    kill_at: tuple[float, ...] = ()
    kill_after_served: int = 5

    @property
    def delay_s(self) -> float:
        return self.timeout_s * 1.5

    def core_faults(self, seed: int) -> dict[str, Any]:
        return {"fail_rate": self.fail_rate, "hang_rate": self.hang_rate, "delay_s": self.delay_s,
                "delay_rate": self.delay_rate, "drop_notify_rate": self.drop_notify_rate,
                "dup_notify_rate": self.dup_notify_rate, "seed": seed}

    def extra(self, port: int, seed: int) -> dict[str, Any]:
        return {"backend": self.backend, "mode": self.mode, "side_channel_port": port,
                "transfer_timeout_s": self.timeout_s, "lease_s": self.lease_s, "load_failure_policy": "recompute",
                "backend_options": {**self.backend_options, "faults": self.core_faults(seed)}}


@dataclass
class SoakResult:
    config: SoakConfig
    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    blocks_verified: int = 0
    loads_ok: int = 0
    load_failures: int = 0
    max_wait_s: float = 0.0
    #: loads the consumer had to give up on (deadline passed before a step): what I2 checked
    loads_past_deadline: int = 0
    violations: list[str] = field(default_factory=list)
    leaks: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    steps: int = 0
    producer_kills: int = 0
    #: loads verified byte for byte, by the producer process (1, 2, ...) their request was sent to
    verified_by_producer: Counter = field(default_factory=Counter)

    def assert_every_producer_served(self) -> None:
        """Every producer process, 1 to ``producer_kills + 1``, served ``kill_after_served``
        loads verified byte for byte. The harness kills a process only once it has, so what
        this adds is the last one, started after the last kill: a restart that never serves
        again fails here (and a process that never serves is never killed: fewer kills)."""
        served = {gen: self.verified_by_producer.get(gen, 0) for gen in range(1, self.producer_kills + 2)}
        assert all(n >= self.config.kill_after_served for n in served.values()), \
            f"loads served per producer process: {served}"

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.config.mode, "backend": self.config.backend,
            "child_producer": self.config.child_producer, "requests": self.requests,
            "outcomes": dict(self.outcomes), "faults_injected": dict(self.faults),
            "faults_total": sum(self.faults.values()), "producer_kills": self.producer_kills,
            "loads_ok": self.loads_ok, "load_failures": self.load_failures,
            "blocks_verified": self.blocks_verified, "max_wait_s": round(self.max_wait_s, 3),
            "loads_past_deadline": self.loads_past_deadline,
            "verified_by_producer": dict(sorted(self.verified_by_producer.items())),
            "leaks": self.leaks, "violations": len(self.violations), "steps": self.steps,
            "elapsed_s": round(self.elapsed_s, 1),
        }


class _ErrorLog(logging.Handler):
    """Collects connector log records that carry a traceback (an exception that was caught
    only by a last-resort handler: a bug)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(self.format(record))


# ----------------------------------------------------------------------------------------
# producers


class LocalProducer:
    """The producer engine in this process."""

    def __init__(self, cfg: SoakConfig, port: int, sc: SideChannelFaults) -> None:
        self.engine = Engine("kv_producer", cfg.extra(port, cfg.seed * 7 + 1), engine_id="P",
                             block_size=cfg.block_size, num_blocks=cfg.num_blocks, max_num_batched_tokens=1024,
                             transmit=sc.transmit)
        self.worker = self.engine.worker._worker
        self.died = False

    def add(self, rid: str, prompt: list[int]) -> None:
        self.engine.add(rid, prompt, 1, {"do_remote_decode": True})

    def abort(self, rid: str) -> None:
        st = self.engine.status(rid)
        if st is not None and not RequestStatus.is_finished(st):
            self.engine.abort(rid)

    def step(self) -> dict[str, dict]:
        params = self.engine.step()
        self.engine.outputs.clear()
        self.engine.kv_outputs.clear()
        self.engine.scheduled_log.clear()
        return params

    def lease_end(self, key: str) -> str | None:
        return self.worker.producer.ended.get(key)

    def idle(self) -> bool:
        return not self.engine.scheduler.requests and not self.worker.producer.holds

    def leaks(self) -> dict[str, int]:
        st = self.worker.agent.stats()
        return {"producer_blocks": self.engine.free0 - self.engine.free_blocks(),
                "producer_pending": st["pending"], "producer_unquiesced": st["unquiesced"],
                "producer_holds": len(self.worker.producer.holds)}

    def faults(self) -> dict[str, int]:
        f = self.worker.agent.faults
        return dict(f.plan.injected) if f is not None else {}

    def alive_threads(self) -> bool:
        return self.worker.server is not None and self.worker.server._thread.is_alive()

    def close(self) -> None:
        self.engine.close()


class ChildProducer:
    """The producer engine in a child process (``_soak_producer.py``), killable with SIGKILL."""

    SCRIPT = HERE / "_soak_producer.py"

    def __init__(self, cfg: SoakConfig, port: int) -> None:
        self.cfg, self.port = cfg, port
        self.generation = 0
        self.died = False
        #: latest cumulative fault counts reported by each producer process
        self.faults_by_gen: dict[int, dict[str, int]] = {}
        self._start()

    def _start(self) -> None:
        self.generation += 1
        extra = self.cfg.extra(self.port, self.cfg.seed * 7 + self.generation)
        sc = {"seed": self.cfg.seed * 13 + self.generation, "drop": self.cfg.sc_drop,
              "dup_frame": self.cfg.sc_dup_frame, "dup_msg": self.cfg.sc_dup_msg,
              "delay": self.cfg.sc_delay, "delay_s": self.cfg.lease_s + 0.5}
        args = {"extra": extra, "sc_faults": sc, "block_size": self.cfg.block_size,
                "num_blocks": self.cfg.num_blocks}
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(VLLM_TESTS), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen([sys.executable, str(self.SCRIPT), json.dumps(args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, bufsize=1)
        self._q: queue.Queue = queue.Queue()
        self._stderr: list[str] = []
        self._reader_thread = threading.Thread(target=self._reader, args=(self.proc, self._q), daemon=True)
        self._reader_thread.start()
        threading.Thread(target=self._err_reader, args=(self.proc,), daemon=True).start()
        self.outstanding: set[str] = set()
        self.last_report: dict[str, Any] = {}
        self.errors: list[str] = []

    @staticmethod
    def _reader(proc: subprocess.Popen, q: queue.Queue) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            q.put(line)

    def _err_reader(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            self._stderr.append(line)
            del self._stderr[:-200]

    def _send(self, **cmd: Any) -> None:
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, ValueError, OSError):
            pass

    def add(self, rid: str, prompt: list[int]) -> None:
        self.outstanding.add(rid)
        self._send(cmd="add", rid=rid, prompt=prompt)

    def abort(self, rid: str) -> None:
        self._send(cmd="abort", rid=rid)

    def step(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        while True:
            try:
                line = self._q.get_nowait()
            except queue.Empty:
                break
            msg = json.loads(line)
            if "params" in msg:
                out.update(msg["params"])
                self.outstanding.difference_update(msg["params"])
            elif "ended" in msg:
                self.outstanding.difference_update(msg["ended"])
            elif "faults" in msg:
                self.faults_by_gen[self.generation] = msg["faults"]
            elif "report" in msg:
                self.last_report = msg["report"]
                self.faults_by_gen[self.generation] = msg["report"].get("faults", {})
            elif "error" in msg:
                self.errors.append(msg["error"])
        return out

    def kill_and_restart(self) -> set[str]:
        """SIGKILL the producer, start a new one on the same port; returns the request ids
        the dead one still owed (they never reach the consumer)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._harvest_dead()
        lost = set(self.outstanding)
        self.died = True
        self._start()
        return lost

    def _harvest_dead(self) -> None:
        """Read what the killed process wrote before it died: its last fault counts (a
        process killed soon after its first step would otherwise take the faults it injected
        with it, and the run would wrongly say a kind was never injected) and its errors.
        Its other lines are dropped: the requests they name are lost with it."""
        self._reader_thread.join(timeout=10)  # ends at EOF: the process is gone
        while True:
            try:
                msg = json.loads(self._q.get_nowait())
            except queue.Empty:
                return
            if "faults" in msg:
                self.faults_by_gen[self.generation] = msg["faults"]
            elif "error" in msg:
                self.errors.append(msg["error"])

    def lease_end(self, key: str) -> str | None:
        return None  # not observable across processes; bytes are still checked

    def drain_report(self, timeout: float) -> dict[str, Any]:
        self.last_report = {}
        self._send(cmd="drain", timeout=timeout)
        end = time.monotonic() + timeout + 30
        while not self.last_report and time.monotonic() < end:
            self.step()
            time.sleep(0.01)
        if not self.last_report:
            raise AssertionError("producer child did not report after drain: " + "".join(self._stderr[-30:]))
        return self.last_report

    def alive_threads(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self._send(cmd="quit")
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# ----------------------------------------------------------------------------------------
# the soak


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    t_added_p: float
    key: str = ""
    fate: str = "normal"  # normal | late | never | p_abort
    forward_at: float = 0.0
    c_abort_at: float | None = None
    in_c: bool = False
    waiting_since: float | None = None
    reported: bool = False
    producer_gen: int = 0


class Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.res = SoakResult(cfg)
        base = free_port_base(8)
        self.sc = SideChannelFaults(cfg.seed * 3 + 1, cfg.sc_drop, cfg.sc_dup_frame, cfg.sc_dup_msg, cfg.sc_delay,
                                    delay_s=cfg.lease_s + 0.5)
        self.errlog = _ErrorLog()
        self.p_port = base
        self.P: LocalProducer | ChildProducer
        self.P = ChildProducer(cfg, base) if cfg.child_producer else LocalProducer(cfg, base, self.sc)
        try:
            self.C = Engine("kv_consumer", cfg.extra(base + 4, cfg.seed * 7 + 99), engine_id="C",
                            block_size=cfg.block_size, num_blocks=cfg.num_blocks, max_num_batched_tokens=1024,
                            transmit=self.sc.transmit)
        except BaseException:
            self.P.close()
            raise
        self.cw = self.C.worker._worker
        self.reqs: dict[str, _Req] = {}
        #: every prompt issued, ended requests' too: an I5 violation names whose KV it found
        self.prompts: dict[str, list[int]] = {}
        self.active: set[str] = set()  # issued and not yet ended everywhere we track
        self.issued = 0
        self.producer_died_at: float | None = None
        #: requests already reported under I2 (once each)
        self._i2_seen: set[str] = set()
        #: loads seen due (deadline passed) at the start of a consumer step
        self._due_seen: set[str] = set()
        self._kills = sorted(int(f * cfg.requests) for f in cfg.kill_at)

    # -------------------------------------------------------------- bookkeeping
    def _violation(self, what: str) -> None:
        if len(self.res.violations) < 200:
            self.res.violations.append(f"[step {self.res.steps}] {what}")

    def _whose_kv(self, rid: str, bad: list[int]) -> str:
        """What the consumer's blocks ``bad`` of ``rid`` hold instead, decoded from the
        harness's KV pattern (token * 1000 + position + layer / 4, layer 0, first head): never
        written (zeros), or which issued requests' tokens at which positions -- so a failure
        names the write that landed there (e.g. a stale write of an earlier request)."""
        C = self.C
        ids = C.block_ids(rid)
        layer0 = next(iter(C.kv_caches.values()))
        parts = []
        for b_i in bad:
            vals = layer0[ids[b_i], 0, :, 0]
            if not torch.any(vals):
                parts.append(f"block {b_i} (id {ids[b_i]}): zeros, never written")
                continue
            toks = torch.div(vals, 1000, rounding_mode="floor").long().tolist()
            pos = torch.round(vals - torch.tensor(toks, dtype=vals.dtype) * 1000).long().tolist()
            # runs of slots holding consecutive positions of the same prompt(s): a run's owners
            # are the prompts matching every slot of it (one token alone matches many)
            runs: list[tuple[int, int, int, set[str]]] = []  # first slot, last slot, last position, owners
            for slot, (t, p) in enumerate(zip(toks, pos)):
                here = ({"zeros"} if not (t or p) else
                        {o for o, prompt in self.prompts.items() if 0 <= p < len(prompt) and prompt[p] == t})
                if runs and runs[-1][2] + 1 == p and runs[-1][3] & here:
                    runs[-1] = (runs[-1][0], slot, p, runs[-1][3] & here)
                else:
                    runs.append((slot, slot, p, here))
            desc = ", ".join(f"slots {lo}-{hi} hold positions {p - (hi - lo)}-{p} of "
                             f"{sorted(o) or 'no issued prompt'}" for lo, hi, p, o in runs)
            parts.append(f"block {b_i} (id {ids[b_i]}): {desc}")
        return "; ".join(parts)

    def _issue(self, now: float) -> None:
        cfg = self.cfg
        rid = f"r{self.issued}"
        self.issued += 1
        n = self.rng.randint(cfg.min_prompt, cfg.max_prompt)
        prompt = [self.rng.randrange(3, 500) for _ in range(n)]
        r = _Req(rid, prompt, now, producer_gen=getattr(self.P, "generation", 0))
        self.prompts[rid] = prompt
        x = self.rng.random()
        if x < cfg.p_abort_rate:
            r.fate = "p_abort"
        elif x < cfg.p_abort_rate + cfg.late_forward_rate:
            r.fate = "late"
        elif x < cfg.p_abort_rate + cfg.late_forward_rate + cfg.never_forward_rate:
            r.fate = "never"
        if r.fate != "normal":
            self.res.faults[{"p_abort": "p_abort", "late": "forward_after_lease", "never": "never_forwarded"}[r.fate]] += 1
        if self.rng.random() < cfg.c_abort_rate:
            # relative to its arrival at the consumer: at once (still waiting for its KV),
            # soon (loading or just loaded), or late (maybe decoding, maybe finished)
            r.c_abort_at = self.rng.choice([0.0, self.rng.uniform(0.0, 0.05), self.rng.uniform(0.0, cfg.timeout_s)])
        self.reqs[rid] = r
        self.active.add(rid)
        self.P.add(rid, prompt)
        if r.fate == "p_abort":
            self.P.abort(rid)  # aborted on the producer before its prefill ran
        self.res.requests += 1

    def _end(self, rid: str, outcome: str) -> None:
        if rid in self.active:
            self.active.discard(rid)
            self.res.outcomes[outcome] += 1
            self.reqs.pop(rid, None)

    def _on_params(self, params: dict[str, dict], now: float) -> None:
        for rid, p in params.items():
            r = self.reqs.get(rid)
            if r is None:
                continue
            r.key = p.get("transfer_id", "")
            r.params = p  # type: ignore[attr-defined]
            if r.fate == "never":
                self._end(rid, "never_forwarded")  # the producer's lease must lapse (checked at the end)
                continue
            if r.fate == "p_abort":  # prefill finished before the abort landed: forward normally
                r.fate = "normal"
            r.forward_at = now + (self.cfg.lease_s + 0.5 if r.fate == "late" else 0.0)

    def _forward(self, now: float) -> None:
        for r in list(self.reqs.values()):
            if not r.in_c and r.forward_at and now >= r.forward_at:
                r.in_c = True
                r.t_in_c = now  # type: ignore[attr-defined]
                self.C.add(r.rid, r.prompt, 2, r.params)  # type: ignore[attr-defined]
                if r.c_abort_at is not None:
                    r.c_abort_at += now

    def _aborts(self, now: float) -> None:
        for r in self.reqs.values():
            if r.in_c and r.c_abort_at is not None and now >= r.c_abort_at:
                r.c_abort_at = None
                st = self.C.status(r.rid)
                if st is not None and not RequestStatus.is_finished(st):
                    self.C.abort(r.rid)
                    r.c_aborted = True  # type: ignore[attr-defined]
                    self.res.faults["c_abort"] += 1

    # -------------------------------------------------------------- one iteration
    def _step_consumer(self, now: float) -> None:
        C = self.C
        waiting_before = {rid for rid, q in C.scheduler.requests.items() if q.status == WFRK}
        tracked_before = set(C.scheduler.requests)
        step_began = time.monotonic()  # the worker's `now` in this step is no earlier
        with self.cw.ctx.lock:
            due = {rid for rid, rec in self.cw.consumer.recv.items() if rec.deadline < step_began}
        self._due_seen |= due
        try:
            C.step()
        except Exception as exc:  # I1
            import traceback

            self._violation(f"I1 exception escaped the consumer step: {exc!r}\n{traceback.format_exc()}")
            raise
        kvo = C.kv_outputs[-1]
        recv = set(kvo.finished_recving or ())
        failed = set(kvo.failed_recving or ())
        if kvo.kv_connector_stats is not None:
            d = kvo.kv_connector_stats.data
            self.res.loads_ok += d.get("loads_ok", 0)
            self.res.load_failures += d.get("failures", 0)
        # I3 (R1): nothing that waited for remote KV is scheduled before it was reported
        for rid in C.scheduled_log[-1] & waiting_before:
            r = self.reqs.get(rid)
            if r is None or not r.reported:
                self._violation(f"I3 {rid} scheduled while waiting for remote KV")
        # I4 (R3): once, and only for tracked requests
        for rid in recv:
            r = self.reqs.get(rid)
            if rid not in tracked_before:
                self._violation(f"I4 finished_recving names untracked request {rid}")
            if r is None:
                continue
            if r.reported:
                self._violation(f"I4 finished_recving names {rid} twice")
            r.reported = True
            # I5: loaded -> exact bytes, and never after the lease lapsed
            if rid not in failed and C.status(rid) == WFRK:
                bad = C.check_kv(rid, r.prompt, len(r.prompt))
                if bad:
                    self._violation(f"I5 {rid} reported loaded but blocks {bad} differ from the producer's bytes; "
                                    + self._whose_kv(rid, bad))
                self.res.blocks_verified += math.ceil(len(r.prompt) / self.cfg.block_size)
                self.res.verified_by_producer[r.producer_gen] += 1
                if self.cfg.mode == "read":
                    why = self.P.lease_end(r.key)
                    if why is not None and why != "done":
                        self._violation(f"I5 {rid} accepted although the producer's lease ended '{why}'")
        # outcomes of finished requests
        for o in C.outputs:
            if o.finish_reason is not None:
                r = self.reqs.get(o.request_id)
                if r is not None:
                    r.finished = True  # type: ignore[attr-defined]
                    r.finish = str(o.finish_reason)  # type: ignore[attr-defined]
        C.outputs.clear()
        C.kv_outputs.clear()
        C.scheduled_log.clear()
        self._check_deadlines(step_began)
        # the figure: how long requests stayed in WAITING_FOR_REMOTE_KVS (reported only)
        for rid, q in C.scheduler.requests.items():
            r = self.reqs.get(rid)
            if r is None:
                continue
            if q.status == WFRK:
                if r.waiting_since is None:
                    r.waiting_since = now
                self.res.max_wait_s = max(self.res.max_wait_s, now - r.waiting_since)
            elif r.waiting_since is not None and r.reported:
                self.res.max_wait_s = max(self.res.max_wait_s, now - r.waiting_since)
                r.waiting_since = None
        # ended on the consumer: gone from the scheduler
        for r in list(self.reqs.values()):
            if r.in_c and r.rid not in C.scheduler.requests:
                if getattr(r, "c_aborted", False):
                    outcome = "aborted_consumer"
                else:
                    outcome = "finished_" + getattr(r, "finish", "unknown")
                self._end(r.rid, outcome)

    def _check_deadlines(self, step_began: float) -> None:
        """I2 (R2): deadline facts of the consumer's loads after a step begun at ``step_began``.

        The worker advanced every load in that step with a ``now`` no earlier than
        ``step_began``; a load whose deadline was already past had to give up there."""
        cutoff = self.cfg.lease_s + self.cfg.timeout_s
        with self.cw.ctx.lock:
            loads = list(self.cw.consumer.recv.items())
        for rid, rec in loads:
            if rec.deadline >= step_began or rid in self._i2_seen:
                continue
            late = step_began - rec.deadline
            if rec.state in _STILL_WAITING:
                self._i2_seen.add(rid)
                self._violation(f"I2 {rid} still in {rec.state.value} at a step begun {late:.3f}s after "
                                f"its load deadline")
            elif rec.state is RecvState.CANCEL and step_began - rec.silent_since > cutoff:
                # the producer is considered gone only once silent that long (it may answer
                # "pending" while its write is in flight: then the blocks must wait)
                self._i2_seen.add(rid)
                self._violation(f"I2 {rid} still waiting for the cancel ack at a step begun {late:.3f}s "
                                f"after its deadline, the producer silent past lease + transfer timeout "
                                f"({cutoff:.1f}s)")

    def _check_threads(self) -> None:
        if self.cw.server is None or not self.cw.server._thread.is_alive():
            self._violation("I1 consumer side-channel thread died")
        if not self.P.alive_threads() and not isinstance(self.P, ChildProducer):
            self._violation("I1 producer side-channel thread died")

    def iterate(self) -> None:
        now = time.monotonic()
        while len(self.active) < self.cfg.in_flight and self.issued < self.cfg.requests:
            if self._kills and self.issued >= self._kills[0] and self._producer_served():
                self._kills.pop(0)
                self._kill_producer(now)
            self._issue(now)
        try:
            params = self.P.step()
        except Exception as exc:
            self._violation(f"I1 exception escaped the producer step: {exc!r}")
            raise
        self._on_params(params, now)
        self._producer_side_ends(now)
        self._forward(now)
        self._aborts(now)
        self.sc.flush(now)
        self._step_consumer(now)
        self._check_threads()
        self.res.steps += 1

    def _producer_served(self) -> bool:
        """The current producer process has served ``kill_after_served`` verified loads."""
        gen = getattr(self.P, "generation", 0)
        return self.res.verified_by_producer[gen] >= self.cfg.kill_after_served

    def _producer_side_ends(self, now: float) -> None:
        """Requests that never reach the consumer: aborted on the producer, or lost with a
        killed producer."""
        if isinstance(self.P, LocalProducer):
            for r in list(self.reqs.values()):
                if r.fate == "p_abort" and r.rid not in self.P.engine.scheduler.requests and not r.forward_at:
                    self._end(r.rid, "aborted_producer")
        else:
            for r in list(self.reqs.values()):
                if r.fate == "p_abort" and not r.forward_at and r.rid not in self.P.outstanding:
                    self._end(r.rid, "aborted_producer")

    def _kill_producer(self, now: float) -> None:
        assert isinstance(self.P, ChildProducer)
        lost = self.P.kill_and_restart()
        self.producer_died_at = now
        self.res.producer_kills += 1
        self.res.faults["producer_sigkill"] += 1
        for rid in lost:
            r = self.reqs.get(rid)
            if r is not None and not r.forward_at:
                self._end(rid, "lost_with_producer")

    # -------------------------------------------------------------- run
    def run(self, log_every_s: float = 0.0) -> SoakResult:
        cfg = self.cfg
        t0 = time.monotonic()
        logger = logging.getLogger("kvtransport_vllm")
        logger.addHandler(self.errlog)
        last_log = t0
        guard_at = t0 + 60 + cfg.requests * 2.0
        try:
            while self.issued < cfg.requests or self.active:
                self.iterate()
                if log_every_s and time.monotonic() - last_log > log_every_s:
                    last_log = time.monotonic()
                    print(f"soak {cfg.mode}: issued {self.issued}/{cfg.requests} active {len(self.active)} "
                          f"violations {len(self.res.violations)} max_wait {self.res.max_wait_s:.2f}s", flush=True)
                if time.monotonic() > guard_at:  # the harness's own safety stop, not a figure
                    self._violation(f"soak did not finish: {len(self.active)} requests still active: "
                                    f"{sorted(self.active)[:10]}")
                    break
            self._drain()
        finally:
            logger.removeHandler(self.errlog)
            self.res.elapsed_s = time.monotonic() - t0
            self.res.loads_past_deadline = len(self._due_seen)
            self._collect_faults()
            self.P.close()
            self.C.close()
        for rec in self.errlog.records[:20]:
            self._violation(f"I1 connector logged a traceback: {rec}")
        return self.res

    def _drain(self) -> None:
        """Everything ends: no fault is turned off; we only stop issuing and wait."""
        cfg = self.cfg
        end = time.monotonic() + 2 * cfg.timeout_s + 2 * cfg.lease_s + 20
        def idle() -> bool:
            return (not self.C.scheduler.requests and not self.cw.consumer.recv
                    and (not isinstance(self.P, LocalProducer) or self.P.idle()))
        while not idle() and time.monotonic() < end:
            self.iterate()
            time.sleep(0.001)
        self.sc.flush(float("inf"))
        c_stats = self.cw.agent.stats()
        leaks = {"consumer_blocks": self.C.free0 - self.C.free_blocks(), "consumer_pending": c_stats["pending"],
                 "consumer_unquiesced": c_stats["unquiesced"], "consumer_loads": len(self.cw.consumer.recv),
                 "consumer_requests": len(self.C.scheduler.requests)}
        if isinstance(self.P, LocalProducer):
            leaks.update(self.P.leaks())
            leaks["producer_requests"] = len(self.P.engine.scheduler.requests)
        else:
            rep = self.P.drain_report(timeout=2 * cfg.lease_s + 10)
            leaks.update({k: v for k, v in rep.items() if k.startswith("producer_")})
            if self.P.errors:
                self._violation(f"I1 producer child reported: {self.P.errors[:3]}")
        self.res.leaks = leaks
        for k, v in leaks.items():
            if v:
                self._violation(f"I6 leak at the end: {k} = {v}")

    def _collect_faults(self) -> None:
        f = self.res.faults
        for k, v in self.sc.counts.items():
            f[k] += v
        if self.cw.agent is not None and self.cw.agent.faults is not None:
            for k, v in self.cw.agent.faults.plan.injected.items():
                f["core_" + k] += v
        if isinstance(self.P, LocalProducer):
            if self.P.worker.agent is not None:
                for k, v in self.P.faults().items():
                    f["core_" + k] += v
        else:
            for gen in self.P.faults_by_gen.values():
                for k, v in gen.items():
                    f[k] += v
