#!/usr/bin/env python
"""GPU end to end on one CUDA host: real vLLM engines, KVTransportConnector, greedy tokens
checked against a reference engine, the load wait printed beside raw NIXL.

    python bench/gpu_e2e.py --model /models/Llama-3.1-8B-Instruct     # a local model directory

What it runs (``--backends``, ``--modes``, ``--paths`` choose a subset; ``--decode-block-size``
starts the decode engines with another block size, paired by token position):

1. a **reference** engine (no connector) on GPU 0 answers every prompt, greedy;
2. for each backend (``ucx``, ``nixl``) x mode (``read``, ``write``) x path (``direct``:
   the transport moves the GPU KV cache; ``staged``: ``kv_buffer_device: cpu``, host
   staging) a **prefill/decode pair** plus the example proxy (examples/disagg_proxy.py):
   with two GPUs the prefill engine runs on GPU 1 and the decode engine on GPU 0; with one
   GPU both share it, each with half of ``--gpu-memory-utilization``, started one after the
   other. A staged READ pair stages on the decode side only (a READ-mode producer refuses
   staging: the consumer could read its mirror before the copy);
3. every prompt goes through the proxy; its greedy tokens must equal the reference's, and
   the decode engine must have taken the prompt's KV from the prefill engine (vLLM's
   ``external_kv_transfer`` prompt-token counter);
4. the decode engine's load wait (``vllm:kvtransport_remote_kv_wait_seconds``: blocks
   allocated -> load handed to vLLM) and the transfer time and bytes per load, from
   ``/metrics``; then bench/gpu_validate.py moves **the same bytes** (the same number of
   KV ranges of the same size, on the same GPUs) with raw NIXL, and the table puts its
   time beside the load wait.

Prompts are random token ids, ``--prompt-blocks`` blocks plus one token long: the decode
engine loads the prompt's KV and computes only its last token; the reference, asked each
prompt once with ``max_tokens=1`` first, hits its own prefix cache for the same whole
blocks and computes the same last token, so both run the same computation and greedy
tokens are compared exactly. One request at a time.

Engines are ``python -m vllm.entrypoints.openai.api_server`` (tests/e2e/harness.py, the
e2e tests' process harness: own process groups, logs in ``--log-dir``, stopped at exit),
``HF_HUB_OFFLINE=1``, ``CUDA_VISIBLE_DEVICES`` per engine, ports below the kernel's
ephemeral range (kvtransport.testing.ports). ``--enforce-eager`` (no CUDA graphs).

``--memory cpu`` runs the same flow with vLLM's CPU build (engines bound to CPU 0 and 1, raw
NIXL on DRAM): it tests this script, NOT device memory, and says so.

Exit status: 0 every case's tokens equal and every load was remote; 1 otherwise (each
reason printed); 2 this host cannot run it (no CUDA device, no torch, a ROCm torch, no
vLLM, or no model directory), with a one-line reason on stderr. See docs/GPU.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import secrets
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

NO_RUN = 2  # exit status: nothing could be run on this host
BACKENDS = ("ucx", "nixl")
MODES = ("read", "write")
PATHS = ("direct", "staged")
#: a config.json dtype -> bytes per element
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1,
               "float8_e4m3fn": 1, "float8_e5m2": 1}
#: token ids of the prompts stay below this (and the model's vocabulary): ids past a
#: tokenizer's real vocabulary are refused by vLLM, and every tokenizer has this many
PROMPT_ID_CEILING = 32000
PROMPT_ID_FLOOR = 100  # clear of special tokens at the bottom of most vocabularies
WAIT = "vllm:kvtransport_remote_kv_wait_seconds"
XFER_S = "vllm:kvtransport_transfer_seconds"
XFER_BYTES = "vllm:kvtransport_transfer_bytes"
XFER_BLOCKS = "vllm:kvtransport_transfer_blocks"
REMOTE_TOKENS = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})


# ----------------------------------------------------------------------------- arguments
def _list(allowed: tuple[str, ...]) -> Any:
    def parse(s: str) -> list[str]:
        items = [x for x in s.split(",") if x]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{s!r}: choose from {','.join(allowed)}")
        return items
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a local model directory (config.json, weights, tokenizer); "
                                              "engines run with HF_HUB_OFFLINE=1")
    p.add_argument("--backends", type=_list(BACKENDS), default=list(BACKENDS))
    p.add_argument("--modes", type=_list(MODES), default=list(MODES))
    p.add_argument("--paths", type=_list(PATHS), default=list(PATHS),
                   help="direct: the transport moves the GPU KV cache; staged: kv_buffer_device cpu")
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts per case")
    p.add_argument("--prompt-blocks", type=int, default=64, help="each prompt is this many KV blocks plus one token")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt, compared")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decode-block-size", type=int, default=0,
                   help="the decode engines' --block-size (default: --block-size); one must divide the other")
    p.add_argument("--dtype", default="auto", help="vLLM's --dtype (auto: the model's)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="per GPU; with one GPU each engine of a pair gets half")
    p.add_argument("--raw-nixl", choices=["on", "off"], default="on",
                   help="on: raw NIXL moves each case's bytes (bench/gpu_validate.py) beside the load wait")
    p.add_argument("--memory", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: self-test of this script with vLLM's CPU build (engines on CPU 0 and 1, raw NIXL on "
                        "DRAM); it validates NO device memory")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for an engine to become healthy")
    p.add_argument("--log-dir", type=Path, help="engine and proxy logs (default: a new temporary directory)")
    args = p.parse_args(argv)
    for name in ("prompts", "prompt_blocks", "max_tokens", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    d = args.decode_block_size
    if d < 0 or (d and d % args.block_size and args.block_size % d):
        p.error(f"--decode-block-size {d} and --block-size {args.block_size}: one must divide the other")
    if not 0 < args.gpu_memory_utilization <= 1:
        p.error("--gpu-memory-utilization must be in (0, 1]")
    if prompt_len(args) + args.max_tokens > args.max_model_len:
        p.error(f"prompts of {prompt_len(args)} tokens plus {args.max_tokens} generated exceed --max-model-len "
                f"{args.max_model_len}: lower --prompt-blocks or raise --max-model-len")
    return args


def prompt_len(args: argparse.Namespace) -> int:
    """Whole blocks plus one token: the decode engine computes exactly the last token."""
    return args.prompt_blocks * args.block_size + 1


def unavailable_reason(model: Path | None, memory: str = "cuda") -> str | None:
    """Why this host cannot run the check, or None: the GPU first, then vLLM and the model."""
    from bench.gpu_validate import cuda_unavailable_reason

    why = cuda_unavailable_reason() if memory == "cuda" else None
    if why is not None:
        return why
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (install vLLM's CUDA build next to kvtransport[vllm])"
    if model is None:
        return "--model PATH is required (a local model directory)"
    if not (model / "config.json").is_file():
        return f"--model {model}: no config.json there (a local model directory is needed; HF_HUB_OFFLINE=1)"
    return None


# ----------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class ModelShape:
    """What the KV cache of one token weighs, from the model's config.json."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    dtype_bytes: int
    vocab: int

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    def range_bytes(self, block_size: int) -> int:
        """One K (or V) range of one block of one layer: the unit a load moves (TP 1)."""
        return block_size * self.kv_heads * self.head_dim * self.dtype_bytes


def model_shape(model: Path, dtype: str = "auto") -> ModelShape:
    cfg = json.loads((model / "config.json").read_text())
    text = cfg.get("text_config") if "num_hidden_layers" not in cfg and "text_config" in cfg else cfg
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    name = (text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype") or "bfloat16") \
        if dtype == "auto" else dtype
    name = str(name).replace("torch.", "")
    if name not in DTYPE_BYTES:
        raise SystemExit(f"gpu_e2e: dtype {name!r} of {model} is not one of {sorted(DTYPE_BYTES)}: pass --dtype")
    return ModelShape(int(text["num_hidden_layers"]), kv_heads, head_dim, name, DTYPE_BYTES[name],
                      int(text.get("vocab_size") or cfg["vocab_size"]))


def make_prompts(shape: ModelShape, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` distinct prompts of random token ids, ``length`` tokens each."""
    rng = random.Random(seed)
    top = min(shape.vocab, PROMPT_ID_CEILING)
    return [[rng.randrange(PROMPT_ID_FLOOR, top) for _ in range(length)] for _ in range(n)]


# ----------------------------------------------------------------------------- the plan
@dataclass
class EngineSpec:
    """One vLLM engine as it will be started: where, with which settings."""

    name: str
    gpu: int
    gpu_memory_utilization: float
    kv_transfer_config: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    block_size: int = 0  # 0: --block-size

    def extra_args(self, args: argparse.Namespace) -> list[str]:
        """vLLM flags on top of the harness's (later flags win: dtype, block size, length)."""
        block = self.block_size or args.block_size
        out = ["--dtype", args.dtype, "--block-size", str(block), "--max-model-len", str(args.max_model_len)]
        if args.memory == "cuda":
            out += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:.3f}"]
        return out


@dataclass
class Case:
    backend: str
    mode: str
    path: str
    prefill: EngineSpec
    decode: EngineSpec
    #: one GPU shared: start the engines one after the other (each measures free memory)
    sequential: bool

    @property
    def label(self) -> str:
        return f"{self.backend} {self.mode.upper()} {self.path}"


def kv_config(role: str, mode: str, backend: str, port: int, staged: bool) -> dict[str, Any]:
    from bench.e2e_latency import kvt_config

    cfg = kvt_config(role, mode, backend, port)
    if staged:
        cfg["kv_connector_extra_config"]["kv_buffer_device"] = "cpu"
    return cfg


def plan(args: argparse.Namespace, gpus: int, secret: str, port: Any) -> tuple[EngineSpec, list[Case]]:
    """The reference engine and every case's pair: GPUs, memory share, connector config and
    environment per engine. ``port()`` gives a free port (a side channel's)."""
    two = gpus >= 2
    util = args.gpu_memory_utilization
    share = util if two else util / 2
    reference = EngineSpec("reference", 0, util)
    cases = []
    for backend in args.backends:
        for mode in args.modes:
            for path in args.paths:
                tag = f"{backend}-{mode}-{path}"
                staged = path == "staged"
                env = {"KVTRANSPORT_SECRET": secret}
                # a READ-mode producer refuses staging: the READ pair stages on the decode side only
                pre = EngineSpec(f"prefill-{tag}", 1 if two else 0, share,
                                 kv_config("kv_producer", mode, backend, port(), staged and mode == "write"),
                                 dict(env))
                dec = EngineSpec(f"decode-{tag}", 0, share, kv_config("kv_consumer", mode, backend, port(), staged),
                                 dict(env), args.decode_block_size)
                cases.append(Case(backend, mode, path, pre, dec, sequential=not two))
    return reference, cases


def server(spec: EngineSpec, model: Path, log_dir: Path, args: argparse.Namespace) -> Any:
    """The harness's vLLM server for this spec, on its GPU only (``--memory cpu``: its
    "GPU" index is the CPU its OpenMP threads are bound to)."""
    from tests.e2e import harness

    cuda = args.memory == "cuda"
    env = dict(spec.env, CUDA_VISIBLE_DEVICES=str(spec.gpu)) if cuda else dict(spec.env)
    return harness.vllm_server(spec.name, model, log_dir, cpu=None if cuda else spec.gpu,
                               kv_transfer_config=spec.kv_transfer_config, extra_args=spec.extra_args(args),
                               env_extra=env)


# ----------------------------------------------------------------------------- measuring
def hist(metrics: dict[str, float], name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram over all its label sets."""
    total = count = 0.0
    for key, value in metrics.items():
        base = key.split("{", 1)[0]
        if base == name + "_sum":
            total += value
        elif base == name + "_count":
            count += value
    return total, count


def delta_mean(before: dict[str, float], after: dict[str, float], name: str) -> tuple[float, int]:
    """(mean of the observations between two scrapes, how many)."""
    s0, c0 = hist(before, name)
    s1, c1 = hist(after, name)
    n = int(round(c1 - c0))
    return ((s1 - s0) / n if n else math.nan), n


def load_figures(before: list[dict[str, float]], after: list[dict[str, float]],
                 mode: str) -> tuple[float, float, float, float]:
    """(mean load wait ms, mean transfer ms, bytes per load, blocks per load) between two
    scrapes of the [prefill, decode] engines' metrics: waits are the decode engine's;
    transfers are counted where they are posted (decode in READ mode, prefill in WRITE mode)."""
    wait, loads = delta_mean(before[1], after[1], WAIT)
    side = 1 if mode == "read" else 0
    xfer, _ = delta_mean(before[side], after[side], XFER_S)
    moved = hist(after[side], XFER_BYTES)[0] - hist(before[side], XFER_BYTES)[0]
    blocks = hist(after[side], XFER_BLOCKS)[0] - hist(before[side], XFER_BLOCKS)[0]
    return wait * 1e3, xfer * 1e3, (moved / loads if loads else 0.0), (blocks / loads if loads else 0.0)


@dataclass
class Compared:
    equal: int
    total: int
    #: (prompt index, first differing token position) of each mismatch
    diverged: list[tuple[int, int]]

    @property
    def ok(self) -> bool:
        return self.equal == self.total and self.total > 0

    def describe(self) -> str:
        if self.ok:
            return f"{self.equal}/{self.total} equal"
        first = ", ".join(f"prompt {i} at token {t}" for i, t in self.diverged[:3])
        return f"{self.equal}/{self.total} equal (differ: {first})"


def compare(reference: list[list[int]], got: list[list[int] | None]) -> Compared:
    """Greedy tokens of each prompt against the reference's (None: the request failed, -1)."""
    diverged = []
    for i, (ref, toks) in enumerate(zip(reference, got)):
        if toks is None:
            diverged.append((i, -1))
        elif toks != ref:
            at = next((k for k, (a, b) in enumerate(zip(ref, toks)) if a != b), min(len(ref), len(toks)))
            diverged.append((i, at))
    return Compared(len(reference) - len(diverged), len(reference), diverged)


@dataclass
class Row:
    label: str
    compared: Compared
    remote_loads: int  # prompts whose KV the decode engine took from the prefill engine
    wait_ms: float  # mean load wait (decode engine)
    transfer_ms: float  # mean time of one transfer (a load is one or more)
    bytes_per_load: float  # bytes moved / loads
    blocks_per_load: float = 0.0  # KV blocks moved / loads
    raw_ms: float | None = None  # raw NIXL moving the same ranges
    note: str = ""  # why the case did not run (fails it)
    raw_note: str = ""  # why raw NIXL has no time for it (does not fail it)

    @property
    def ok(self) -> bool:
        return self.compared.ok and self.remote_loads == self.compared.total and not self.note


def load_ranges(bytes_per_load: float, blocks_per_load: float, shape: ModelShape,
                block_size: int) -> tuple[int, int]:
    """(ranges, bytes each) for raw NIXL to move a load's bytes the way a load is cut on
    vLLM's GPU layouts: one range per K or V part of a block of a layer. From the measured
    blocks when known (whatever dtype the engines chose), else from config.json's shape."""
    if blocks_per_load:
        count = max(1, round(blocks_per_load * shape.layers * 2))
        return count, max(1, round(bytes_per_load / count))
    size = shape.range_bytes(block_size)
    return max(1, round(bytes_per_load / size)), size


def raw_nixl_command(count: int, size: int, out: Path, memory: str = "cuda",
                     python: str = sys.executable) -> list[str]:
    """bench/gpu_validate.py moving ``count`` ranges of ``size`` bytes over nixl, raw NIXL beside."""
    region_mib = max(16, math.ceil(2 * count * size / 2**20))
    return [python, str(REPO / "bench" / "gpu_validate.py"), "--backends", "nixl", "--paths", "direct",
            "--sizes-mib", "", "--scatter", f"{count}x{size}", "--region-mib", str(region_mib),
            "--iters", "5", "--memory", memory, "--json", str(out)]


def raw_ms_from(report: dict[str, Any], op: str) -> float | None:
    """Raw NIXL's median time for ``op`` from gpu_validate's --json report."""
    for r in report.get("rows", []):
        if r["op"] == op and r["raw GB/s"]:
            return r["MiB"] * 2**20 / (r["raw GB/s"] * 1e9) * 1e3
    return None


def format_report(rows: list[Row], shape: ModelShape, args: argparse.Namespace, gpus: int) -> str:
    if getattr(args, "memory", "cuda") == "cpu":
        where = "vLLM CPU build, prefill on CPU 1, decode on CPU 0 (self-test: NO device memory)"
    else:
        where = "prefill on cuda:1, decode on cuda:0" if gpus >= 2 else "prefill and decode share cuda:0"
    head = (f"model {args.model} ({shape.layers} layers, {shape.kv_heads} KV heads x {shape.head_dim}, "
            f"{shape.dtype}: {shape.kv_bytes_per_token / 1024:.0f} KiB of KV per token); block {args.block_size}; "
            f"{args.prompts} prompts x {prompt_len(args)} tokens, {args.max_tokens} greedy tokens; {where}")
    cols = f"{'case':<22}{'tokens vs reference':<30}{'remote KV':>10}{'load wait ms':>14}{'transfer ms':>13}" \
           f"{'MiB/load':>10}{'raw NIXL ms':>13}{'wait/raw':>10}"
    lines = [head, "", cols, "-" * len(cols)]
    fmt = lambda x: "-" if x is None or math.isnan(x) else f"{x:.3f}"  # noqa: E731
    for r in rows:
        ratio = r.wait_ms / r.raw_ms if r.raw_ms and not math.isnan(r.wait_ms) else None
        lines.append(f"{r.label:<22}{r.compared.describe():<30}{f'{r.remote_loads}/{r.compared.total}':>10}"
                     f"{fmt(r.wait_ms):>14}{fmt(r.transfer_ms):>13}{fmt(r.bytes_per_load / 2**20):>10}"
                     f"{fmt(r.raw_ms):>13}{fmt(ratio):>10}")
    lines.append("load wait: blocks allocated -> load handed to vLLM (decode engine, mean); raw NIXL: the same "
                 "number of KV ranges of the same size, NIXL's API, same GPUs (bench/gpu_validate.py)")
    for r in rows:
        for note in (r.note, r.raw_note):
            if note:
                lines.append(f"{r.label}: {note}")
    bad = [r for r in rows if not r.ok]
    lines.append(f"{len(rows) - len(bad)} of {len(rows)} cases passed")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the device step
def _ask(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    from tests.e2e import prompts

    return prompts.complete(prompts.client(url, timeout=600), prompt, max_tokens)


def reference_tokens(spec: EngineSpec, model: Path, log_dir: Path, args: argparse.Namespace,
                     prompt_set: list[list[int]]) -> list[list[int]]:
    from tests.e2e import harness

    s = server(spec, model, log_dir, args)
    try:
        harness.start_all([s], timeout_s=args.startup_timeout)
        out = []
        for p in prompt_set:
            _ask(s.url, p, 1)  # the prompt's whole blocks into the prefix cache, as a prefill engine has them
            out.append(_ask(s.url, p, args.max_tokens))
        return out
    finally:
        s.stop()


def run_case(case: Case, model: Path, log_dir: Path, args: argparse.Namespace, prompt_set: list[list[int]],
             reference: list[list[int]]) -> Row:
    from tests.e2e import harness

    pre, dec = server(case.prefill, model, log_dir, args), server(case.decode, model, log_dir, args)
    proxy = harness.proxy_process(f"proxy-{case.backend}-{case.mode}-{case.path}", log_dir, pre.url, dec.url,
                                  prefill_timeout_s=600, decode_timeout_s=600)
    procs = [pre, dec, proxy]
    try:
        try:
            if case.sequential:  # one GPU: the second engine sees the first one's memory taken
                for s in procs:
                    harness.start_all([s], timeout_s=args.startup_timeout)
            else:
                harness.start_all(procs, timeout_s=args.startup_timeout)
        except (harness.ServerDied, TimeoutError) as exc:
            first = str(exc).splitlines()[0]
            return Row(case.label, compare(reference, [None] * len(reference)), 0, math.nan, math.nan, 0.0,
                       note=f"did not start: {first}")
        before = [pre.metrics(), dec.metrics()]
        got: list[list[int] | None] = []
        remote = 0
        for p in prompt_set:
            r0 = dec.metric(REMOTE_TOKENS[0], **REMOTE_TOKENS[1])
            try:
                got.append(_ask(proxy.url, p, args.max_tokens))
            except Exception as exc:  # noqa: BLE001 - a failed request is a failed prompt, reported
                got.append(None)
                print(f"[gpu_e2e] {case.label}: request failed: {type(exc).__name__}: {exc}", flush=True)
            remote += dec.metric(REMOTE_TOKENS[0], **REMOTE_TOKENS[1]) > r0
        after = [pre.metrics(), dec.metrics()]
        return Row(case.label, compare(reference, got), int(remote), *load_figures(before, after, case.mode))
    finally:
        for s in procs:
            s.stop()


def raw_nixl_beside(rows: list[Row], cases: list[Case], shape: ModelShape, args: argparse.Namespace,
                    log_dir: Path) -> None:
    """Raw NIXL's time for each case's bytes, in the rows; once per distinct load shape."""
    done: dict[tuple[int, int], dict[str, Any]] = {}
    for row, case in zip(rows, cases):
        if not row.bytes_per_load:
            continue
        count, size = load_ranges(row.bytes_per_load, row.blocks_per_load, shape, args.block_size)
        if (count, size) not in done:
            out = log_dir / f"raw-nixl-{count}x{size}.json"
            cmd = raw_nixl_command(count, size, out, args.memory)
            print(f"[gpu_e2e] raw NIXL: {count} ranges of {size} bytes: {' '.join(cmd[1:])}", flush=True)
            with open(log_dir / f"raw-nixl-{count}x{size}.log", "w") as log:
                subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
            done[(count, size)] = json.loads(out.read_text()) if out.exists() else {}
        report = done[(count, size)]
        row.raw_ms = raw_ms_from(report, case.mode.upper())
        if row.raw_ms is None:
            row.raw_note = (f"raw NIXL n/a: {report.get('raw_note') or 'no time measured'} "
                            f"(log: {log_dir / f'raw-nixl-{count}x{size}.log'})")


def run(args: argparse.Namespace) -> int:
    if args.memory == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    else:
        gpus = 2  # the self-test: engines bound to CPU 0 and 1
        print("*** --memory cpu: tests this script with vLLM's CPU build; it validates NO device memory ***",
              flush=True)
    model = args.model.resolve()
    shape = model_shape(model, args.dtype)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvt-gpu-e2e-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    from kvtransport.testing.ports import free_port_range

    reference_spec, cases = plan(args, gpus, secrets.token_hex(16), lambda: free_port_range(1))
    prompt_set = make_prompts(shape, args.prompts, prompt_len(args))
    print(f"[gpu_e2e] {gpus if args.memory == 'cuda' else 'no'} GPU(s); logs in {log_dir}; {len(cases)} cases",
          flush=True)
    from tests.e2e import harness

    try:
        reference = reference_tokens(reference_spec, model, log_dir, args, prompt_set)
    except (harness.ServerDied, TimeoutError) as exc:
        print(f"gpu_e2e: the reference engine did not start: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    rows = []
    for case in cases:
        print(f"[gpu_e2e] {case.label} ...", flush=True)
        rows.append(run_case(case, model, log_dir, args, prompt_set, reference))
    if args.raw_nixl == "on":
        raw_nixl_beside(rows, cases, shape, args, log_dir)
    print(format_report(rows, shape, args, gpus))
    return 0 if all(r.ok for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = unavailable_reason(args.model, args.memory)
    if why is not None:
        print(f"gpu_e2e: cannot run the GPU end-to-end check on this host: {why}", file=sys.stderr)
        return NO_RUN
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
