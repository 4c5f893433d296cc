"""Process harness for the end-to-end tests: real ``vllm`` OpenAI servers as subprocesses.

Why a harness of its own: every engine is a separate OS process tree (API server +
EngineCore).  Tests must (a) never leave one running, (b) fail fast with the
server's own log when it dies during start-up, and (c) be able to *kill* an engine
abruptly (SIGKILL of the whole process group) to test peer death.

Each server is started in a new session, so its process-group id is its pid and
``os.killpg`` reaches the EngineCore child too -- and nothing else.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtransport.testing.ports import free_port_range

REPO = Path(__file__).resolve().parents[2]


def disagg_proxy_module() -> types.ModuleType:
    """examples/disagg_proxy.py as a module (its request-building helpers), loaded once."""
    if "disagg_proxy" not in sys.modules:
        spec = importlib.util.spec_from_file_location("disagg_proxy", REPO / "examples" / "disagg_proxy.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["disagg_proxy"] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules["disagg_proxy"]
PYTHON = sys.executable
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024


def free_port() -> int:
    """A TCP port free right now, below the kernel's ephemeral range (see
    :mod:`kvtransport.testing.ports`: a port from ``bind(0)`` can be taken by another socket
    before the server that was meant to have it starts)."""
    return free_port_range(1)


def free_side_channel_base(n: int) -> int:
    """A port with ``n`` consecutive free ports from it (a side channel's base: rank r
    listens on base + r), below the kernel's ephemeral range: vLLM's engines pick their own
    internal ports (a TP=2 engine several) by binding port 0, i.e. from that range, and one
    of them took a side-channel port chosen there before the engines started (seen:
    "Address already in use" at start-up)."""
    return free_port_range(n)


def base_env(cpu: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        # The tiny model needs almost no KV memory; 1 GiB is the smallest setting.
        VLLM_CPU_KVCACHE_SPACE="1",
        PYTHONUNBUFFERED="1",
        # every thread's Python stack to the log on a fatal signal: stall_report() sends
        # SIGABRT to a stalled server's processes to see where each one waits
        PYTHONFAULTHANDLER="1",
        # the engines' INFO lines are evidence some tests read (e.g. the busy-wait yield each
        # engine chose); never inherit a quieter level another test module set in this process
        VLLM_LOGGING_LEVEL="INFO",
    )
    if cpu is not None:
        # One OpenMP thread pinned per engine: two engines share 2 cores fairly.
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    return env


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the test process dies, however it dies.

    Without it a killed or timed-out pytest would leave engines running (and holding
    ports and memory) until the machine is recycled. Linux only; elsewhere a no-op.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class ServerDied(RuntimeError):
    pass


@dataclass
class Proc:
    """A subprocess in its own process group, logging to a file."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    _log_file: Any = field(default=None, repr=False)

    def start(self) -> "Proc":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(f"\n=== start {self.name}: {' '.join(self.cmd)}\n".encode())
        self._log_file.flush()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=self._log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(REPO),
            preexec_fn=_die_with_parent,
        )
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n_chars: int = 6000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return text[-n_chars:]

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # the group we created: this server only
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """Abrupt death (SIGKILL to the whole group): what a crash looks like to peers."""
        self._signal_group(signal.SIGKILL)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def stop(self, grace_s: float = 15.0) -> None:
        """Orderly shutdown, escalating to SIGKILL; always reaps the whole group."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # EngineCore children may outlive the API server: reap the group regardless.
        self._signal_group(signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


@dataclass
class VllmServer(Proc):
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout_s: float = 240.0) -> float:
        """Block until GET /health is 200; returns seconds since start(). Raises with the log if it dies."""
        t0 = self.started_at
        give_up_at = t0 + timeout_s  # a safety stop for a server that never comes up
        while time.monotonic() < give_up_at:
            if not self.alive:
                raise ServerDied(f"{self.name} exited with {self.proc.returncode} during start-up; "
                                 f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy after {timeout_s}s; log {self.log_path}:\n"
                           f"{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        """Prometheus text from /metrics -> {'name{labels}': value}."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
        return out

    def metric(self, name: str, **labels: str) -> float:
        """Sum of all series of ``name`` whose labels include ``labels``."""
        total = 0.0
        for key, value in self.metrics().items():
            m = re.fullmatch(r"([^{]+)(?:\{(.*)\})?", key)
            if not m or m.group(1) != name:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                total += value
        return total


#: engine metrics worth seeing when requests stall (prefixes of Prometheus names)
_STALL_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "vllm:kvtransport_loads_in_flight", "vllm:kvtransport_holds_in_flight",
                  "vllm:kvtransport_outcomes_total")


def _group_processes(pgid: int) -> list[tuple[int, str, str]]:
    """(pid, name, ``ps`` line: state, CPU, CPU%, CPU time, wait channel) of one process group."""
    try:  # bounded: ps blocks on a process stuck in the kernel (a CI run lost 25 minutes so)
        out = subprocess.run(["ps", "-e", "-o", "pgid=,pid=,stat=,psr=,pcpu=,time=,wchan:22=,comm="],
                             capture_output=True, text=True, timeout=20).stdout
    except subprocess.TimeoutExpired:
        return [(pgid, "?", "ps did not answer within 20 s: a process on this host is stuck in the kernel")]
    rows = []
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 8 and f[0] == str(pgid):
            rows.append((int(f[1]), " ".join(f[7:]), " ".join(f[1:])))
    return rows


def _kernel_threads(pid: int) -> str:
    """Each thread of ``pid`` as the kernel sees it, grouped: state (R running, S sleeping,
    D uninterruptible, T stopped) and wait channel, e.g. ``9 S futex_do_wait, 1 R``; then the
    innermost kernel frames of each thread not in S (``/proc/<pid>/task/<tid>/stack``, root
    only). Where a process writes no Python stack at SIGABRT, this is what is left to see (a
    thread inside the kernel does not take the signal). Reads only ``stat``, ``wchan`` and
    ``stack`` files, which take none of the process's locks."""
    counts: dict[str, int] = {}
    stacks: list[str] = []
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return "gone"
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[0].decode()
            with open(f"{base}/wchan") as f:
                wchan = f.read().strip()
        except (OSError, IndexError):
            continue
        key = f"{state} {wchan}" if wchan not in ("", "0") else state
        counts[key] = counts.get(key, 0) + 1
        if state != "S":
            try:
                with open(f"{base}/stack") as f:
                    top = [line.split()[-1].split("+")[0] for line in f.read().splitlines()[:4]]
            except OSError:
                top = []
            if top:
                stacks.append(f"tid {tid} {state}: {' < '.join(top)}")
    shown = ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return shown + ("" if not stacks else "; " + "; ".join(stacks))


def _thread_summary(dump: str) -> list[str]:
    """From one process's faulthandler output: per thread its innermost frame and, when
    that is library code, the innermost frame of vLLM or kvtransport (what it waits in)."""
    threads: list[tuple[str, list[str]]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append((line.split(" (")[0], []))
        elif threads and line.strip().startswith("File "):
            threads[-1][1].append(line.strip())
    out = []
    for name, frames in threads:
        if not frames:
            continue
        ours = next((f for f in frames if "kvtransport" in f or "/vllm/" in f), None)
        out.append(f"    {name}: {frames[0]}" + (f"  <- {ours}" if ours and ours != frames[0] else ""))
    return out


def stall_report(servers: list[VllmServer], stacks: bool = True) -> str:
    """Where each server stands when requests did not finish: selected metrics, its
    processes as the kernel sees them (state, CPU, CPU%, wait channel; per thread, state and
    wait channel, and the kernel frames of any thread not asleep) and, with ``stacks``,
    each thread's innermost Python frame, written by faulthandler (PYTHONFAULTHANDLER in
    base_env) on SIGABRT, all processes frozen first. **This ends the servers**, so call it
    last. Compact, so that it survives a CI log that keeps only the end of the output; also
    appended to ``stall-report.txt`` in the servers' log directory."""
    parts, procs = [], []
    for s in servers:
        try:
            ms = {k: v for k, v in s.metrics().items() if k.startswith(_STALL_METRICS) and v}
            shown = ", ".join(f"{k.replace('vllm:', '')}={v:g}" for k, v in sorted(ms.items()))
        except Exception as exc:  # noqa: BLE001 - a report must not raise
            shown = f"metrics unavailable ({type(exc).__name__})"
        parts.append(f"[{s.name}] {shown}")
        if s.proc is not None and s.proc.poll() is None:
            rows = _group_processes(s.proc.pid)
            parts += [f"  {line}\n    threads: {_kernel_threads(pid)}" for pid, _, line in rows]
            procs += [(s, pid, name) for pid, name, _ in rows]
    if not stacks:
        return _kept(servers, "\n".join(parts))
    # Freeze every process first: one that dies makes its engine tear down (a worker's death
    # ends the engine core and then the API server), which would change what the others show.
    # Then one at a time: SIGABRT and SIGCONT, so the abort (signal 6) is handled first and
    # its dump is the state at the freeze, and dumps do not interleave in a shared log.
    for _, pid, _ in procs:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    for s, pid, name in procs:
        before = s.log_path.stat().st_size  # start() created it
        try:
            os.kill(pid, signal.SIGABRT)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            continue
        deadline, last = time.monotonic() + 5, -1
        while time.monotonic() < deadline:  # until its dump has stopped growing
            time.sleep(0.3)
            size = s.log_path.stat().st_size
            if size > before and size == last:
                break
            last = size
        with open(s.log_path, errors="replace") as f:
            f.seek(before)
            lines = _thread_summary(f.read())
        parts.append(f"[{s.name}] pid {pid} {name}, innermost frames at SIGABRT:")
        # none: every thread that could take the signal is inside the kernel (or the process ended)
        parts += lines or [f"    (no Python stack written) threads: {_kernel_threads(pid)}"]
    return _kept(servers, "\n".join(parts))


def _kept(servers: list[VllmServer], report: str) -> str:
    """``report``, also appended to ``stall-report.txt`` beside the first server's log: a CI
    run cut short (or a log that keeps only the end) loses what pytest prints last."""
    if servers:
        path = servers[0].log_path.parent / "stall-report.txt"
        try:
            with open(path, "a") as f:
                f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')}\n{report}\n")
            report += f"\n(kept in {path})"
        except OSError:
            pass
    return report


def vllm_server(name: str, model: Path, log_dir: Path, cpu: int | None,
                kv_transfer_config: dict | None = None, extra_args: list[str] | None = None,
                env_extra: dict[str, str] | None = None) -> VllmServer:
    port = free_port()
    cmd = [
        PYTHON, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model), "--served-model-name", "tiny",
        "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
        "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
        "--max-num-seqs", "64", "--seed", "0",
    ]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    cmd += extra_args or []
    env = base_env(cpu)
    env.update(env_extra or {})
    return VllmServer(name=name, cmd=cmd, env=env, log_path=log_dir / f"{name}.log", port=port)


def proxy_process(name: str, log_dir: Path, prefill_url: str | list[str], decode_url: str | list[str],
                  prefill_timeout_s: float = 60.0, decode_timeout_s: float = 120.0,
                  extra_args: list[str] | None = None) -> VllmServer:
    """The documented example proxy (examples/disagg_proxy.py), run exactly as a user would
    (``extra_args``: e.g. ``--flow router`` and its side-channel flags); a list of URLs
    gives it several engines of that side (round-robin)."""
    port = free_port()
    urls = [("--prefill", u) for u in ([prefill_url] if isinstance(prefill_url, str) else prefill_url)]
    urls += [("--decode", u) for u in ([decode_url] if isinstance(decode_url, str) else decode_url)]
    cmd = [PYTHON, str(REPO / "examples" / "disagg_proxy.py"), "--port", str(port),
           *(x for flag_url in urls for x in flag_url),
           "--prefill-timeout", str(prefill_timeout_s), "--decode-timeout", str(decode_timeout_s)]
    cmd += extra_args or []
    return VllmServer(name=name, cmd=cmd, env=base_env(None), log_path=log_dir / f"{name}.log",
                      port=port)


def side_channel_port(server: VllmServer) -> int:
    """The ``side_channel_port`` a server was started with (from its --kv-transfer-config)."""
    cfg = json.loads(server.cmd[server.cmd.index("--kv-transfer-config") + 1])
    return int(cfg["kv_connector_extra_config"]["side_channel_port"])


def start_all(servers: list[VllmServer], timeout_s: float = 300.0) -> dict[str, float]:
    """Start servers together (start-up is mostly imports) and wait for all; on failure stop all."""
    for s in servers:
        s.start()
    took = {}
    try:
        for s in servers:
            took[s.name] = s.wait_healthy(timeout_s)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return took
