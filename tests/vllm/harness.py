"""A real vLLM ``Scheduler`` on CPU, driven step by step, with a real connector worker.

No mocked scheduler: :class:`Engine` builds ``vllm.v1.core.sched.scheduler.Scheduler``
from a real ``VllmConfig`` (a tiny local Llama config, offline), the connector through
vLLM's own factory (so the ``vllm.general_plugins`` registration is exercised), and a
worker-role connector that owns real paged KV tensors in vLLM's CPU layout
``[num_blocks, kv_heads, block_size, 2*head_size]`` per layer.

The "model runner" here is the only stand-in: instead of attention it writes a known
pattern (a function of token id, position and layer) into the KV slots of every token
it computes, and samples a fixed token. That makes the bytes a consumer loads checkable
against what the producer computed, block by block.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# The connector refuses to start without a side-channel secret (or an explicit "off"):
# every engine built here (and producer subprocesses, which inherit the environment)
# shares this one, as the engines of one cluster would.
TEST_SECRET = "kvtransport-test-cluster-secret"
os.environ.setdefault("KVTRANSPORT_SECRET", TEST_SECRET)

import torch  # noqa: E402

from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvtransport.testing.ports import free_port_range  # noqa: E402
from kvtransport_vllm.plugin import register  # noqa: E402
from kvtransport_vllm.side_channel import SideChannelClient, Transmit  # noqa: E402

NUM_LAYERS = 2
KV_HEADS = 2
HEAD_SIZE = 64
EOS = 2
_MODEL_DIR: str | None = None
_none_hash = False
_ids = itertools.count(1)


def tiny_model_dir() -> str:
    """A local Llama config (no weights needed: the scheduler never loads them)."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        from transformers import LlamaConfig

        d = os.path.join(tempfile.gettempdir(), f"kvt-tiny-llama-{os.getuid()}")
        if not os.path.exists(os.path.join(d, "config.json")):
            os.makedirs(d, exist_ok=True)
            LlamaConfig(
                hidden_size=KV_HEADS * HEAD_SIZE, intermediate_size=256, num_hidden_layers=NUM_LAYERS,
                num_attention_heads=KV_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_SIZE,
                vocab_size=512, max_position_embeddings=4096, eos_token_id=EOS, torch_dtype="float32",
            ).save_pretrained(d)
        _MODEL_DIR = d
    return _MODEL_DIR


def free_port_base(n: int = 4) -> int:
    """A base port with ``n`` consecutive free ports (side channel: base + tp_rank), below the
    kernel's ephemeral range, so no connection opened meanwhile can take one of them
    (:mod:`kvtransport.testing.ports`)."""
    return free_port_range(n)


def make_vllm_config(kv_role: str, extra: dict[str, Any], block_size: int = 16, engine_id: str | None = None,
                     max_num_batched_tokens: int = 256, kv_connector_module_path: str | None = None,
                     kv_load_failure_policy: str = "fail", dp_rank: int = 0) -> VllmConfig:
    """A real VllmConfig for the tiny model. ``dp_rank`` > 0 makes it the config of that
    data-parallel rank as vLLM's engine-core process leaves it for a dense model:
    ``parallel_config.data_parallel_index`` set to the rank (``EngineCoreProc`` does this),
    ``data_parallel_rank`` reset to 0 (``reconfigure_for_independent_dp_rank``)."""
    model_config = ModelConfig(model=tiny_model_dir(), skip_tokenizer_init=True, dtype="float32", seed=0,
                               max_model_len=2048)
    scheduler_config = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens, max_model_len=2048,
        enable_chunked_prefill=True, is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=block_size, cache_dtype="auto", enable_prefix_caching=True)
    ktc = KVTransferConfig(
        kv_connector="KVTransportConnector", kv_role=kv_role, engine_id=engine_id,
        kv_connector_module_path=kv_connector_module_path, kv_connector_extra_config=extra,
        kv_load_failure_policy=kv_load_failure_policy,
    )
    cfg = VllmConfig(model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config,
                     kv_transfer_config=ktc, device_config=DeviceConfig("cpu"))
    if dp_rank:
        cfg.parallel_config.data_parallel_index = dp_rank
    return cfg


def kv_pattern(token_ids: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
    """What the stand-in model writes for a token: distinct per token, position, layer."""
    return token_ids.float() * 1000.0 + positions.float() + layer * 0.25


class Engine:
    """One engine: real Scheduler + scheduler-role connector + worker-role connector."""

    #: False: a model runner that only binds (the connector must take the work there)
    calls_handle_preemptions = True

    @staticmethod
    def between_hooks(so: Any) -> None:
        """What runs between handle_preemptions and bind_connector_metadata, given the
        scheduler output (vLLM prepares the step's inputs there); a test may set its own."""

    def __init__(self, kv_role: str, extra: dict[str, Any], *, block_size: int = 16, num_blocks: int = 64,
                 engine_id: str | None = None, connector_cls: type | None = None,
                 kv_load_failure_policy: str = "fail", max_num_batched_tokens: int = 256,
                 dp_rank: int = 0, sliding_window: int | None = None, transmit: Transmit | None = None) -> None:
        """``transmit``: how the worker's side-channel clients send (a lossy network model;
        default: seal and send)."""
        global _none_hash
        register()
        if not _none_hash:
            init_none_hash(sha256)
            _none_hash = True
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.engine_id = engine_id or f"{kv_role}-{next(_ids)}"
        self.vllm_config = make_vllm_config(kv_role, extra, block_size, self.engine_id,
                                            max_num_batched_tokens=max_num_batched_tokens,
                                            kv_load_failure_policy=kv_load_failure_policy, dp_rank=dp_rank)
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        #: KV cache group of each layer: with ``sliding_window`` the engine is a hybrid model
        #: (vLLM's hybrid KV cache manager) laid out as vLLM lays out such a Llama: layer 0
        #: sliding window of that many tokens (group 0), layer 1 full attention (group 1),
        #: each group with its own block ids.
        self.sliding_window = sliding_window
        self.layer_group = [0, 1] if sliding_window else [0] * NUM_LAYERS
        self.full_group = 1 if sliding_window else 0
        full = FullAttentionSpec(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                                 dtype=torch.float32)
        if sliding_window:
            sw = SlidingWindowSpec(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                                   dtype=torch.float32, sliding_window=sliding_window)
            groups = [KVCacheGroupSpec(["layers.0"], sw), KVCacheGroupSpec(["layers.1"], full)]
        else:
            groups = [KVCacheGroupSpec([f"layers.{i}" for i in range(NUM_LAYERS)], full)]
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        if connector_cls is not None:
            name = f"_Test{connector_cls.__name__}"
            try:  # refused when an earlier engine of this process registered it
                KVConnectorFactory.register_connector(name, connector_cls.__module__, connector_cls.__qualname__)
            except ValueError as exc:
                if "already registered" not in str(exc):
                    raise
            self.vllm_config.kv_transfer_config.kv_connector = name
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config, log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vllm_config), block_size=block_size,
        )
        self.connector = self.scheduler.connector
        self.worker = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER,
                                                          self.kv_cache_config)
        if transmit is not None:  # before any client exists: each takes it when made
            self.worker._worker.ctx.transmit = transmit
        self.kv_caches = {
            f"layers.{i}": torch.zeros(num_blocks, KV_HEADS, block_size, 2 * HEAD_SIZE, dtype=torch.float32)
            for i in range(NUM_LAYERS)
        }
        self.worker.register_kv_caches(self.kv_caches)
        self.free0 = self.free_blocks()
        self.outputs: list[Any] = []
        self.scheduled_log: list[set[str]] = []
        #: request id -> number of tokens already computed when it was first scheduled
        #: (0: a full prefill here, nothing taken from a remote load)
        self.first_start: dict[str, int] = {}
        self.kv_outputs: list[KVConnectorOutput] = []
        #: requests the stand-in runner emits no row for (the seed's failure shape)
        self.no_row: Callable[[str], bool] = lambda rid: False

    # ------------------------------------------------------------------
    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def add(self, request_id: str, prompt: list[int], max_tokens: int, kv_transfer_params: dict | None) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                      block_hasher=get_request_block_hasher(self.block_size, sha256))
        req.kv_transfer_params = dict(kv_transfer_params) if kv_transfer_params is not None else None
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)

    def status(self, request_id: str) -> RequestStatus | None:
        req = self.scheduler.requests.get(request_id)
        return None if req is None else req.status

    def _compute_kv(self, so: Any) -> None:
        """The stand-in forward: write the KV pattern of every scheduled token."""
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            start = self._before[rid]
            pos = torch.arange(start, start + n)
            all_tokens = torch.tensor(list(req.all_token_ids) + [0] * (start + n), dtype=torch.int64)
            toks = all_tokens[start:start + n]
            ids = self.scheduler.kv_cache_manager.get_block_ids(rid)
            slot = pos % self.block_size
            for li, t in enumerate(self.kv_caches.values()):
                blk = torch.tensor(ids[self.layer_group[li]], dtype=torch.int64)[pos // self.block_size]
                t[blk, :, slot, :] = kv_pattern(toks, pos, li)[:, None, None]

    def step(self) -> dict[str, Any]:
        """One engine step: schedule, run the connector worker hooks, 'forward', update."""
        so = self.scheduler.schedule()
        self.scheduled_log.append(set(so.num_scheduled_tokens))
        self._before = {rid: self.scheduler.requests[rid].num_computed_tokens - n
                        for rid, n in so.num_scheduled_tokens.items()}
        for rid, start in self._before.items():
            self.first_start.setdefault(rid, start)
        w = self.worker
        # vLLM's model runner (0.32-0.33) calls handle_preemptions with the step's metadata
        # first, then prepares the step's inputs (``between_hooks`` stands in), then binds
        if self.calls_handle_preemptions:
            w.handle_preemptions(so.kv_connector_metadata)
        self.between_hooks(so)
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)
        self._compute_kv(so)
        w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        kvo = KVConnectorOutput(
            finished_sending=res.finished_sending or None, finished_recving=res.finished_recving or None,
            failed_recving=res.failed_recving, invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_stats=w.get_kv_connector_stats(),
        )
        w.clear_connector_metadata()
        self.kv_outputs.append(kvo)
        rows = [rid for rid in so.num_scheduled_tokens if not self.no_row(rid)]
        sampled = []
        for rid in rows:
            req = self.scheduler.requests[rid]
            done_prefill = self._before[rid] + so.num_scheduled_tokens[rid] >= req.num_tokens
            sampled.append([7] if done_prefill else [])
        mro = ModelRunnerOutput(req_ids=rows, req_id_to_index={r: i for i, r in enumerate(rows)},
                                sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                pooler_output=[], kv_connector_output=kvo)
        return record_outputs(self.scheduler.update_from_output(so, mro), self.outputs)

    def close(self) -> None:
        self.worker.shutdown()

    def block_ids(self, rid: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])

    def check_kv(self, rid: str, prompt: list[int], upto: int) -> list[int]:
        """Block indexes of ``rid`` whose first ``upto`` token slots differ from the pattern.

        A sliding-window layer is checked only in the blocks its group still holds (vLLM
        replaces blocks that fell out of the window by its null block, id 0) and only for
        the tokens inside the window of the last prompt token: attention reads nothing
        else, so nothing else has to be moved."""
        all_ids = self.scheduler.kv_cache_manager.get_block_ids(rid)
        first_needed = max(0, upto - self.sliding_window) if self.sliding_window else 0
        bad = []
        for b_i in range(len(all_ids[self.full_group])):
            lo = b_i * self.block_size
            hi = min(upto, lo + self.block_size)
            if hi <= lo:
                break
            for li, t in enumerate(self.kv_caches.values()):
                g = self.layer_group[li]
                sliding = g != self.full_group
                lo_l = max(lo, first_needed) if sliding else lo
                if hi <= lo_l:
                    continue
                b = all_ids[g][b_i]
                if sliding and b == 0:
                    bad.append(b_i)  # a block inside the window that the group does not hold
                    break
                pos = torch.arange(lo_l, hi)
                toks = torch.tensor(prompt[lo_l:hi])
                want = kv_pattern(toks, pos, li)[:, None, None].expand(hi - lo_l, KV_HEADS, 2 * HEAD_SIZE)
                got = t[b, :, lo_l - lo: hi - lo, :].permute(1, 0, 2)
                if not torch.equal(got, want):
                    bad.append(b_i)
                    break
        return bad


def record_outputs(engine_outputs: dict[Any, Any], into: list[Any]) -> dict[str, dict]:
    """Append each request output of ``Scheduler.update_from_output`` to ``into``; return
    the ``kv_transfer_params`` they carry, by request id (what a proxy would forward)."""
    params = {}
    for eco in engine_outputs.values():
        for o in eco.outputs:
            into.append(o)
            if o.kv_transfer_params is not None:
                params[o.request_id] = o.kv_transfer_params
    return params


def run_until(engines: Iterable[Engine], cond: Callable[[], bool], timeout: float = 10.0,
              on_params: Callable[[dict], None] | None = None) -> float:
    """Step every engine until ``cond()``; returns the seconds it took. Fails on timeout."""
    engines = list(engines)
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not reached within {timeout}s")
        for e in engines:
            params = e.step()
            if params and on_params:
                on_params(params)
        time.sleep(0.002)
    return time.monotonic() - t0


def prompt_of(n: int, seed: int = 1) -> list[int]:
    return [(seed * 31 + i * 7) % 500 + 3 for i in range(n)]


class Pair:
    """A producer and a consumer engine wired through real side channels on loopback."""

    def __init__(self, mode: str = "read", *, p_extra: dict | None = None, c_extra: dict | None = None,
                 policy: str = "recompute", timeout_s: float = 5.0, lease_s: float = 10.0,
                 c_block_size: int = 16, consumer_cls: type | None = None,
                 sliding_window: int | None = None, transmit: Transmit | None = None) -> None:
        base = free_port_base(8)
        common = {"backend": "loopback", "mode": mode, "transfer_timeout_s": timeout_s, "lease_s": lease_s,
                  "load_failure_policy": policy}
        self.p_port, self.c_port = base, base + 4
        self.P = Engine("kv_producer", {**common, "side_channel_port": base, **(p_extra or {})}, engine_id="P",
                        sliding_window=sliding_window, transmit=transmit)
        try:
            self.C = Engine("kv_consumer", {**common, "side_channel_port": base + 4, **(c_extra or {})},
                            engine_id="C", block_size=c_block_size, connector_cls=consumer_cls,
                            sliding_window=sliding_window, transmit=transmit)
        except BaseException:
            self.P.close()
            raise
        self.params: dict[str, dict] = {}

    @property
    def engines(self) -> list[Engine]:
        return [self.P, self.C]

    def prefill(self, rid: str, prompt: list[int]) -> dict:
        self.P.add(rid, prompt, 1, {"do_remote_decode": True})
        run_until([self.P], lambda: rid in self.params, on_params=self.params.update)
        return self.params[rid]

    def run(self, cond: Callable[[], bool], timeout: float = 10.0) -> float:
        return run_until(self.engines, cond, timeout, on_params=self.params.update)

    def drain(self, timeout: float = 15.0) -> None:
        """Step both engines until no request is left anywhere."""
        self.run(lambda: not self.P.scheduler.requests and not self.C.scheduler.requests, timeout)

    def run_to_end_checking_kv(self, rid: str, prompt: list[int], timeout: float = 30.0,
                               on_step: Callable[[], None] | None = None) -> list[list[int]]:
        """Step until the consumer's ``rid`` is gone. The first time it is RUNNING with the
        whole prompt computed, record ``check_kv`` of the prompt (the blocks that differ
        from the pattern); returns the records (one, or none if never seen so).
        ``on_step`` is called after every round of steps."""
        seen: list[list[int]] = []

        def ended() -> bool:
            if on_step is not None:
                on_step()
            req = self.C.scheduler.requests.get(rid)
            if (not seen and req is not None and self.C.status(rid) == RequestStatus.RUNNING
                    and req.num_computed_tokens >= len(prompt)):
                seen.append(self.C.check_kv(rid, prompt, len(prompt)))
            return req is None

        self.run(ended, timeout)
        return seen

    def assert_recomputed(self, rid: str, prompt: list[int], kv_checks: list[list[int]]) -> None:
        """What a user checks of a load that failed under policy "recompute", without a
        model: the request finished normally, it was scheduled from token 0 (a full local
        prefill, nothing used from the failed load), and its prompt KV was the locally
        computed one (``kv_checks`` from :meth:`run_to_end_checking_kv`)."""
        assert finish_reason(self.C, rid) == "length", f"{rid} not recomputed: {finish_reason(self.C, rid)}"
        assert self.C.first_start.get(rid) == 0, f"{rid} not rescheduled from token 0: {self.C.first_start.get(rid)}"
        assert kv_checks == [[]], f"{rid}: recomputed KV differs from the prompt's in blocks {kv_checks}"

    def assert_no_leak(self) -> None:
        """R4: both block pools are back to their starting free count."""
        assert self.P.free_blocks() == self.P.free0, "producer leaked blocks"
        assert self.C.free_blocks() == self.C.free0, "consumer leaked blocks"

    def close(self) -> None:
        self.P.close()
        self.C.close()


def finish_reason(engine: Engine, rid: str) -> str | None:
    for o in engine.outputs:
        if o.request_id == rid and o.finish_reason is not None:
            return str(o.finish_reason)
    return None


def ask_producer(pair: "Pair", msg: Any, timeout: float = 20.0) -> Any:
    """Send ``msg`` to the producer's side channel as an authentic peer; its reply.
    ``timeout`` is a hang guard, not a timing bound."""
    client = SideChannelClient("127.0.0.1", pair.p_port, auth=pair.P.worker._worker.cfg.make_authenticator())
    try:
        cid = client.send(msg)
        end = time.monotonic() + timeout
        while True:
            for reply in client.poll():
                if reply.cid == cid:
                    return reply
            assert time.monotonic() < end, f"no reply to {type(msg).__name__}"
            time.sleep(0.002)
    finally:
        client.close()
