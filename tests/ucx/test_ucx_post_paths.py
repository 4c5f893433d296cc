"""The two posting paths of the ucx backend: the compiled segment loop (``_post.c``) and the
ctypes fallback. Which one an agent uses, how it is chosen, and that both move every byte of
ragged, multi-region, partly adjacent segment lists (the conformance suite runs on both too:
``conformance_options`` in backend.py)."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport.errors import BackendOptionError
from kvtransport_ucx import native as _native
from kvtransport_ucx import ucp as U
from ucx_helpers import skip_unless_ucx_usable

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _need_ucx():
    skip_unless_ucx_usable()


def test_compiled_library_was_built_and_is_the_default():
    """The install (pip install -e . with a C compiler, as scripts/dev.sh does) built
    ``_post.c``; agents use it unless told otherwise."""
    lib, why = _native.library()
    assert lib is not None, why
    with kvt.open("ucx", name="pp-default", tls="shm") as a:
        assert a.describe()["post_path"] == "native"


def test_option_and_environment_choose_the_path(monkeypatch):
    monkeypatch.setenv(_native.ENV, "ctypes")
    with kvt.open("ucx", name="pp-env", tls="shm") as a:
        assert a.describe()["post_path"] == "ctypes"
    with kvt.open("ucx", name="pp-opt", tls="shm", post="native") as a:  # the option wins
        assert a.describe()["post_path"] == "native"


@pytest.mark.parametrize("where", ["option", "env"])
def test_unknown_path_is_refused_naming_the_choices(monkeypatch, where):
    kwargs = {"post": "fast"} if where == "option" else {}
    if where == "env":
        monkeypatch.setenv(_native.ENV, "fast")
    with pytest.raises(BackendOptionError) as ei:
        kvt.open("ucx", name="pp-bad", tls="shm", **kwargs)
    msg = str(ei.value)
    assert "'fast'" in msg and "native" in msg and "ctypes" in msg
    assert ("option post" if where == "option" else _native.ENV) in msg


def _ragged_offsets(rng, size: int, lens: np.ndarray) -> np.ndarray:
    """Random non-overlapping offsets in [0, size) for segments of ``lens`` (< 4096 each);
    every fourth one directly follows its predecessor where it fits."""
    n = len(lens)
    slots = np.sort(rng.choice(size // 4096 - 1, n, replace=False)) * 4096
    offs = slots.copy()
    for i in range(1, n):
        if i % 4 == 0 and offs[i - 1] + lens[i - 1] + lens[i] <= (slots[i + 1] if i + 1 < n else size):
            offs[i] = offs[i - 1] + lens[i - 1]
    return offs.astype(np.int64)


@pytest.mark.parametrize("op", ["READ", "WRITE"])
@pytest.mark.parametrize("path", ["native", "ctypes"])
@pytest.mark.parametrize("tls", ["shm", "tcp"])
def test_both_paths_move_ragged_two_region_segment_lists_byte_exact(tls, path, op):
    """Segments alternate between two registered regions on each side (per-segment remote
    keys and memory handles: the array branches of both paths), random offsets, odd lengths,
    some adjacent on one side or both; split over two lanes (the transfer exceeds lane_split_bytes)."""
    size, n = 4 << 20, 600
    rng = np.random.default_rng(7)
    opts = dict(tls=tls, post=path, lanes=2, lane_split_bytes=1 << 16)
    with kvt.open("ucx", name=f"pp-i-{tls}-{path}", **opts) as a, \
            kvt.open("ucx", name=f"pp-t-{tls}-{path}", **opts) as b:
        assert a.describe()["post_path"] == path
        abufs = [np.random.default_rng(s).integers(0, 256, size, dtype=np.uint8) for s in (1, 2)]
        bbufs = [np.random.default_rng(s).integers(0, 256, size, dtype=np.uint8) for s in (3, 4)]
        aregs = [a.register(x) for x in abufs]
        bregs = [b.register(x) for x in bbufs]
        peer = a.connect(b.metadata())
        b.connect(a.metadata())
        ln = rng.integers(1, 3000, n).astype(np.int64)
        lo = _ragged_offsets(rng, size, ln)
        ro = _ragged_offsets(np.random.default_rng(8), size, ln)
        which_l, which_r = rng.integers(0, 2, n), rng.integers(0, 2, n)
        lids = np.array([r.id for r in aregs], np.int64)[which_l]
        rids = np.array([bregs[0].id, bregs[1].id], np.int64)[which_r]
        local, remote = kvt.Segments(lids, lo, ln), kvt.Segments(rids, ro, ln)
        src_bufs, src_offs, src_w = (bbufs, ro, which_r) if op == "READ" else (abufs, lo, which_l)
        dst_bufs, dst_offs, dst_w = (abufs, lo, which_l) if op == "READ" else (bbufs, ro, which_r)
        expect = [src_bufs[int(src_w[i])][src_offs[i]:src_offs[i] + ln[i]].copy() for i in range(n)]
        fn = a.read if op == "READ" else a.write
        st = fn(peer, local, remote).wait(60)
        assert st.ok, st.reason
        for i in range(n):
            got = dst_bufs[int(dst_w[i])][dst_offs[i]:dst_offs[i] + ln[i]]
            assert np.array_equal(got, expect[i]), f"segment {i} differs ({path}, {tls}, {op})"
        assert all(x > 0 for x in a.describe()["bytes_per_lane"])


# -- the C loop alone, with a recording callback in place of ucp_put_nbx (glue only) ------
_RMA = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                        ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _run_loop(la, ra, ln, rkeys, params, refuse_at=None):
    lib, why = _native.library()
    assert lib is not None, why
    calls, freed = [], []

    def rma(ep, buf, count, raddr, rkey, param):
        calls.append((buf, count, raddr, rkey, param))
        if refuse_at is not None and len(calls) - 1 == refuse_at:
            return (1 << 64) - 3  # UCS_ERR_NO_MEMORY (-3) as a status pointer
        return 0x1000 + len(calls)  # a request handle

    cb, fr = _RMA(rma), _FREE(lambda r: freed.append(r))
    arrs = [np.asarray(x, np.uint64) for x in (la, ra, ln)]
    rk = np.asarray(rkeys, np.uint64)
    pp = np.asarray(params, np.uint64)
    st, at = ctypes.c_int64(), ctypes.c_int64()
    ops = lib.kvt_post_segments(ctypes.cast(cb, ctypes.c_void_p), ctypes.cast(fr, ctypes.c_void_p), 7,
                                *(x.ctypes.data for x in arrs), rk.ctypes.data, int(rk.size > 1),
                                pp.ctypes.data, int(pp.size > 1), len(arrs[0]), ctypes.byref(st), ctypes.byref(at))
    return ops, calls, freed, st.value, at.value


def test_c_loop_merges_only_runs_adjacent_on_both_sides_with_the_same_key_glue_only():
    la = [100, 110, 120, 500, 510, 600]
    ra = [900, 910, 920, 300, 999, 700]  # 3rd..: 500->300 new run; 510 not adjacent remotely
    ln = [10, 10, 5, 10, 10, 4]
    ops, calls, freed, st, at = _run_loop(la, ra, ln, [11], [22])
    assert st == 0 and at == -1
    assert [(c[0], c[1], c[2]) for c in calls] == [(100, 25, 900), (500, 10, 300), (510, 10, 999), (600, 4, 700)]
    assert ops == 4 and len(freed) == 4 and all(c[3] == 11 and c[4] == 22 for c in calls)
    # adjacent on both sides but a different remote key (another region): not merged
    ops, calls, *_ = _run_loop([0, 8], [0, 8], [8, 8], [1, 2], [5])
    assert ops == 2 and [c[3] for c in calls] == [1, 2]


def test_c_loop_stops_at_a_refused_post_and_names_it_glue_only():
    ops, calls, freed, st, at = _run_loop([0, 100, 200], [0, 100, 200], [10, 10, 10], [1], [2], refuse_at=1)
    assert ops == 1 and len(calls) == 2 and st == -3 and at == 1
    assert len(freed) == 1  # only the accepted request; an error status is not a request


@pytest.mark.parametrize("path", ["native", "ctypes"])
def test_inline_progress_drives_a_cma_copy_to_its_end_on_both_paths(path):
    """``post`` drives lane 0 on the caller's thread (``Poster.share``: the C loop, or the
    Python loop of the fallback). With cma each progress call copies one 512 KiB fragment, so
    a 4 MiB READ takes 8 calls: with a budget that cannot run out the transfer is DONE when
    ``post`` returns (the loop went on to the end, not one call); with a budget of a
    nanosecond the progress thread finishes it. Every byte is checked both times."""
    n = 4 << 20
    src = np.frombuffer(np.random.default_rng(11).bytes(n), np.uint8).copy()
    for budget, done_at_post in ((1.0, True), (1e-9, None)):
        dst = np.zeros(n, np.uint8)
        with kvt.open("ucx", name=f"drive-a-{path}", tls="shm", post=path, lanes=1, inline_progress_s=budget) as a, \
                kvt.open("ucx", name=f"drive-b-{path}", tls="shm", post=path, lanes=1) as b:
            ra, rb = a.register(dst), b.register(src)
            peer = a.connect(b.metadata())
            # The first transfer also completes the endpoints' wire-up, which needs the
            # peer's progress: only the second one is all cma copy.
            assert a.read(peer, ra.whole(), peer.region(rb.id).whole()).wait(60).ok
            dst[:] = 0
            t = a.read(peer, ra.whole(), peer.region(rb.id).whole())
            if done_at_post:
                assert t.status().ok  # DONE, not PENDING
            assert t.wait(60).ok
        assert dst.tobytes() == src.tobytes()


# -- one share end to end (post, flush, drive) against scripted libucp functions (glue only) --
_FLUSH = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_PROGRESS = ctypes.CFUNCTYPE(ctypes.c_uint, ctypes.c_void_p)
_CHECK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_ERR_PTR = (1 << 64) - 3  # UCS_ERR_NO_MEMORY (-3) as a status pointer
_FLUSH_REQ = 0x5000


class _ScriptedUcp:
    """Stands in for libucp in ``Poster``: records every call; the flush answers
    ``flush_returns``, the flush request stays in progress for ``busy_checks`` status
    checks and then ends with ``ends_with``; the RMA post numbered ``refuse_at`` is refused."""

    def __init__(self, flush_returns=_FLUSH_REQ, busy_checks=0, ends_with=0, refuse_at=None):
        self.log: list[tuple] = []
        self.busy = busy_checks

        def rma(ep, buf, count, raddr, rkey, param):
            self.log.append(("rma", buf, count, raddr))
            return _ERR_PTR if refuse_at is not None and len(self.rmas) - 1 == refuse_at else 0x1000 + len(self.log)

        def flush(ep, param):
            self.log.append(("flush",))
            return flush_returns

        def progress(worker):
            self.log.append(("progress",))
            return 1

        def check(req):
            assert req == _FLUSH_REQ
            self.log.append(("check",))
            if self.busy > 0:
                self.busy -= 1
                return 1  # UCS_INPROGRESS
            return ends_with

        self.ucp_get_nbx = self.ucp_put_nbx = _RMA(rma)
        self.ucp_request_free = _FREE(lambda r: self.log.append(("free", r)))
        self.ucp_ep_flush_nbx = _FLUSH(flush)
        self.ucp_worker_progress = _PROGRESS(progress)
        self.ucp_request_check_status = _CHECK(check)

    @property
    def rmas(self):
        return [e for e in self.log if e[0] == "rma"]

    def count(self, what):
        return sum(e[0] == what for e in self.log)


class _OneRegion:
    """``LocalMemory`` stand-in: no per-region parameters (every segment gets the default)."""

    def local_params(self, regions, default):
        return itertools.repeat(default)

    def local_param_table(self, regions, default):
        return default


def _share(path, ucp, budget_s, la=(100, 200, 500), ra=(900, 800, 300), ln=(10, 10, 8)):
    if path == "native":
        assert _native.library()[0] is not None
    poster = _native.Poster(ucp, _OneRegion(), U.ucp_request_param_t(), native=path == "native")
    arrs = [np.asarray(x, np.uint64) for x in (la, ra, ln)]
    return poster.share(False, 7, 9, *arrs, np.zeros(len(la), np.int64), 11, budget_s)


@pytest.mark.parametrize("path", ["native", "ctypes"])
def test_share_whose_flush_ends_while_driven_is_released_and_reported_done_glue_only(path):
    ucp = _ScriptedUcp(busy_checks=3, ends_with=0)
    rma_st, req, st = _share(path, ucp, budget_s=1.0)
    assert (rma_st, req, st) == (0, None, 0)
    assert [e[1:] for e in ucp.rmas] == [(100, 10, 900), (200, 10, 800), (500, 8, 300)]
    assert ucp.count("progress") == 3 and ucp.log[-1] == ("free", _FLUSH_REQ)


@pytest.mark.parametrize("path", ["native", "ctypes"])
def test_share_without_budget_leaves_the_flush_in_progress_to_the_caller_glue_only(path):
    ucp = _ScriptedUcp(busy_checks=1)
    rma_st, req, st = _share(path, ucp, budget_s=0.0)
    assert (rma_st, req, st) == (0, _FLUSH_REQ, 1)  # UCS_INPROGRESS: the owner tracks it
    assert ucp.count("progress") == 0 and ucp.count("free") == 3  # only the RMA requests


@pytest.mark.parametrize("path", ["native", "ctypes"])
def test_share_reports_a_flush_that_ends_in_error_glue_only(path):
    ucp = _ScriptedUcp(busy_checks=1, ends_with=-3)
    assert _share(path, ucp, budget_s=1.0) == (0, None, -3)
    assert ucp.log[-1] == ("free", _FLUSH_REQ)
    ucp = _ScriptedUcp(flush_returns=_ERR_PTR)  # the flush itself refused: no request at all
    assert _share(path, ucp, budget_s=1.0) == (0, None, -3)
    assert ucp.count("check") == 0 and ucp.count("progress") == 0


@pytest.mark.parametrize("path", ["native", "ctypes"])
def test_share_flushes_what_was_posted_before_a_refused_post_glue_only(path):
    ucp = _ScriptedUcp(flush_returns=0, refuse_at=1)  # second run refused; flush done at once
    rma_st, req, st = _share(path, ucp, budget_s=1.0, la=(0, 100, 200), ra=(0, 100, 200), ln=(10, 10, 10))
    assert (rma_st, req, st) == (-3, None, 0)
    assert len(ucp.rmas) == 2 and ucp.count("flush") == 1  # nothing after the refused post


def test_segment_addresses_are_remembered_per_array_and_forgotten_with_it():
    """``_Addresses``: the same three arrays (a prepared transfer's) give their data addresses
    from the cache; another array in the same place of the triple is looked up afresh; an
    entry leaves with its local-address array, so the cache never outgrows the live arrays."""
    cache = _native._Addresses()
    la, ra, ln = (np.arange(4, dtype=np.uint64) + k for k in (0, 10, 20))
    first = cache(la, ra, ln)
    assert first == (la.ctypes.data, ra.ctypes.data, ln.ctypes.data)
    assert cache(la, ra, ln) == first and len(cache._by_id) == 1
    other = np.arange(4, dtype=np.uint64)
    assert cache(la, other, ln) == (la.ctypes.data, other.ctypes.data, ln.ctypes.data)
    del la
    assert len(cache._by_id) == 0
    for _ in range(100):  # one-shot posts: fresh arrays each time, nothing kept
        cache(*(np.zeros(2, np.uint64) for _ in range(3)))
    assert len(cache._by_id) == 0
