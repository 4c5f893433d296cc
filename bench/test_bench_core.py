"""Core and loopback benchmarks.

* Descriptor building: 16,384 blocks -> segments on both sides, validated against the
  registered regions and merged — the work ``Agent.read/write`` do before posting.
  Target: under 1 ms.
* Loopback transfers, in one process and across two processes, for 16 MiB, 256 MiB and
  4096 scattered 16 KiB blocks, READ and WRITE, beside a single-thread memcpy of the same
  bytes (numpy ``copyto`` between two buffers in this process). Target: cross-process
  256 MiB at >= 60% of memcpy.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport.spi import Op
from kvtransport.testing.peer import ChildProcessPeer, InProcessPeer

MiB = 1 << 20
CASES = {
    "16MiB": dict(size=16 * MiB, block=16 * MiB, n=1),
    "256MiB": dict(size=256 * MiB, block=256 * MiB, n=1),
    "4096x16KiB-scattered": dict(size=128 * MiB, block=16 * 1024, n=4096),
}


def test_descriptor_build_validate_merge_16384_blocks(benchmark):
    """16,384 blocks across 32 layers x K/V parts of a registered cache."""
    agent_a = kvt.open("loopback", name="desc-a")
    agent_b = kvt.open("loopback", name="desc-b")
    nblocks, block = 16384, 256
    bufs_a = [np.zeros(nblocks * block, np.uint8) for _ in range(2)]
    bufs_b = [np.zeros(nblocks * block, np.uint8) for _ in range(2)]
    ra = [agent_a.register(b) for b in bufs_a]
    rb = [agent_b.register(b) for b in bufs_b]
    peer = agent_b.connect(agent_a.metadata())
    lay_l = kvt.BlockLayout([(r, 0) for r in rb], block, nblocks)
    lay_r = kvt.BlockLayout([(peer.region(r.id), 0) for r in ra], block, nblocks)
    rng = np.random.default_rng(0)
    lids = rng.permutation(nblocks)[: nblocks // 2]
    rids = rng.permutation(nblocks)[: nblocks // 2]  # 2 parts x 8192 = 16,384 segments

    def build():
        return agent_b.prepare(Op.READ, peer, lay_l.segments(lids), lay_r.segments(rids))

    req = benchmark(build)
    assert req.length.size == 16384
    benchmark.extra_info["segments"] = 16384
    agent_a.close()
    agent_b.close()


@pytest.fixture(scope="module", params=["inproc", "xproc"])
def loop_pair(request):
    size = max(c["size"] for c in CASES.values())
    peer_cls = InProcessPeer if request.param == "inproc" else ChildProcessPeer
    far = peer_cls("loopback", {}, f"bench-far-{request.param}", size, 3)
    local = kvt.open("loopback", name=f"bench-local-{request.param}")
    buf = np.ones(size, np.uint8)
    region = local.register(buf)
    peer = local.connect(far.metadata())
    yield request.param, local, region, peer, peer.region(far.region_id), buf
    local.close()
    far.close()


def _segments(case, region, remote, seed):
    c = CASES[case]
    if c["n"] == 1:
        return region.segments([0], [c["size"]]), remote.segments([0], [c["size"]])
    nblk = c["size"] // c["block"]
    rng = np.random.default_rng(seed)
    lids = rng.permutation(nblk)[: c["n"]]
    rids = rng.permutation(nblk)[: c["n"]]
    return (kvt.BlockLayout([(region, 0)], c["block"], nblk).segments(lids),
            kvt.BlockLayout([(remote, 0)], c["block"], nblk).segments(rids))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("op", ["read", "write"])
def test_loopback_transfer(benchmark, loop_pair, case, op):
    topo, local, region, peer, remote, buf = loop_pair
    seg_l, seg_r = _segments(case, region, remote, 1)
    fn = local.read if op == "read" else local.write

    def once():
        st = fn(peer, seg_l, seg_r).wait(60)
        assert st.ok, st

    benchmark.pedantic(once, rounds=8 if case != "256MiB" else 4, warmup_rounds=1)
    benchmark.group = case
    benchmark.extra_info.update(case=case, bytes=seg_l.nbytes)
    benchmark.name = f"loopback-{topo}-{op}-{case}"


@pytest.mark.parametrize("case", list(CASES))
def test_memcpy_baseline(benchmark, case):
    """Single-thread memcpy of the same bytes (scattered: one copy per block, vectorised
    with numpy fancy indexing, which is a gather + scatter)."""
    c = CASES[case]
    src = np.ones(c["size"], np.uint8)
    dst = np.zeros(c["size"], np.uint8)
    if c["n"] == 1:
        def once():
            np.copyto(dst, src)
        nbytes = c["size"]
    else:
        nblk = c["size"] // c["block"]
        rng = np.random.default_rng(1)
        lids, rids = rng.permutation(nblk)[: c["n"]], rng.permutation(nblk)[: c["n"]]
        s2, d2 = src.reshape(nblk, c["block"]), dst.reshape(nblk, c["block"])

        def once():
            d2[lids] = s2[rids]
        nbytes = c["n"] * c["block"]
    benchmark.pedantic(once, rounds=8 if case != "256MiB" else 4, warmup_rounds=1)
    benchmark.group = case
    benchmark.extra_info.update(case=case, bytes=nbytes, baseline=True)
    benchmark.name = f"memcpy-single-thread-{case}"
