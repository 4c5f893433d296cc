"""The ucx backend's transport list and device memory, against the real libucp.

UCX closes every memory domain that none of the selected transports belongs to, so a
context opened with ``UCX_TLS=tcp`` does not know CUDA memory even on a GPU host, and
``register`` of a GPU KV cache fails. ``device_memory`` adds UCX's ``cuda`` alias to an
explicit list; a user's ``UCX_TLS`` that leaves the cuda transports out is refused naming it.

What runs where: the transport list UCX holds is read back from a real ``ucp_config_t``
(``ucp_config_print``) on any host. Whether the CUDA memory type of a real context follows
that list can only be seen where UCX has its CUDA transports (a CUDA driver): on a GPU-less
host UCX reports no CUDA memory under any list, and that test says so by skipping.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile
import textwrap
from ctypes import byref, c_void_p

import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport.registry import available_backends

pytest.importorskip("kvtransport_ucx")
from kvtransport_ucx import memory as _memory, ucp as U  # noqa: E402
from kvtransport.ucx_config import TLS_ALIASES  # noqa: E402
from kvtransport_ucx.options import parse_options  # noqa: E402

UCS_CONFIG_PRINT_CONFIG = 1
UNMAPPED = 0x10_0000
NO_DEVICE_HERE = frozenset()
CUDA_HERE = frozenset({"cuda"})


def _ucx_usable() -> None:
    info = {i.name: i for i in available_backends()}.get("ucx")
    if info is None or not info.usable:
        pytest.skip(f"backend ucx is not usable here: {info and info.reason}")


@pytest.fixture
def lib(monkeypatch):
    """The real libucp, with no UCX_TLS from the caller's environment."""
    _ucx_usable()
    monkeypatch.delenv("UCX_TLS", raising=False)
    lib = U.lib()
    lib.ucp.ucp_config_print.restype = None
    lib.ucp.ucp_config_print.argtypes = [c_void_p, c_void_p, ctypes.c_char_p, ctypes.c_int]
    return lib


def _config(lib, settings: dict[str, str]) -> c_void_p:
    """A UCP configuration built the way the backend's worker builds it: read, then
    ``ucp_config_modify`` for each setting (it refuses a value UCX cannot parse)."""
    cfg = c_void_p()
    U.check(lib.ucp.ucp_config_read(None, None, byref(cfg)), "ucp_config_read")
    for key, value in settings.items():
        st = lib.ucp.ucp_config_modify(cfg, key.encode(), value.encode())
        if st != U.UCS_OK:
            lib.ucp.ucp_config_release(cfg)
            raise AssertionError(f"UCX refused {key}={value!r}: {lib.status_string(st)}")
    return cfg


def _printed(lib, cfg: c_void_p) -> dict[str, str]:
    """The configuration as UCX prints it (``ucp_config_print``), as a dict of UCX_* values."""
    libc = ctypes.CDLL(None)
    libc.fdopen.restype = c_void_p
    libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
    libc.fclose.argtypes = [c_void_p]
    with tempfile.TemporaryFile("w+") as f:
        stream = libc.fdopen(os.dup(f.fileno()), b"w")
        lib.ucp.ucp_config_print(cfg, stream, b"kvt", UCS_CONFIG_PRINT_CONFIG)
        libc.fclose(stream)
        f.seek(0)
        lines = f.read().splitlines()
    return dict(ln.split("=", 1) for ln in lines if ln.startswith("UCX_") and "=" in ln)


def _memory_types(lib, settings: dict[str, str]) -> list[str]:
    """What a real context opened with ``settings`` reports moving (``ucp_context_query``,
    ``memory_types``: the question ``register`` asks)."""
    cfg = _config(lib, {**settings, "WARN_INVALID_CONFIG": "n"})
    try:
        params = U.ucp_params_t()
        params.field_mask = U.UCP_PARAM_FIELD_FEATURES
        params.features = U.UCP_FEATURE_RMA | U.UCP_FEATURE_AM
        ctx = c_void_p()
        U.check(lib.ucp.ucp_init_version(U.UCP_API_MAJOR, U.UCP_API_MINOR, byref(params), cfg, byref(ctx)),
                "ucp_init")
    finally:
        lib.ucp.ucp_config_release(cfg)
    try:
        return _memory.type_names(_memory.context_memory_types(lib.ucp, ctx))
    finally:
        lib.ucp.ucp_cleanup(ctx)


@pytest.mark.parametrize("tls,expected", [("tcp", "tcp,cuda"), ("cma+tcp", "cma,tcp,cuda"),
                                          ("shm", "sysv,posix,cma,cuda"), ("rc,tcp", "rc,tcp,cuda"),
                                          ("tcp,cuda_copy", "tcp,cuda_copy"), ("^rc", "^rc")])
def test_device_memory_cuda_hands_ucx_a_transport_list_with_the_cuda_transports(lib, tls, expected):
    opts = parse_options({"tls": tls, "device_memory": "cuda"}, environ={}, kinds_here=lambda: NO_DEVICE_HERE)
    settings = opts.ucx_settings()
    assert settings["TLS"] == expected
    cfg = _config(lib, settings)
    try:
        held = _printed(lib, cfg)
    finally:
        lib.ucp.ucp_config_release(cfg)
    assert held["UCX_TLS"] == expected  # what UCX itself holds after ucp_config_modify
    # the error-handling choice is the user's list's (cuda transports report no peer failure)
    assert opts.err_mode == parse_options({"tls": tls, "device_memory": "none"}, environ={}).err_mode


@pytest.mark.parametrize("tls", ["tcp", "shm", "cma+tcp"])
def test_auto_adds_cuda_transports_only_where_this_ucx_moves_cuda(lib, tls):
    given = TLS_ALIASES[tls]
    assert parse_options({"tls": tls}, environ={}, kinds_here=lambda: CUDA_HERE).tls == f"{given},cuda"
    assert parse_options({"tls": tls}, environ={}, kinds_here=lambda: NO_DEVICE_HERE).tls == given
    assert parse_options({"tls": tls, "device_memory": "none"}, environ={}, kinds_here=lambda: CUDA_HERE).tls == given
    # the real question, asked of this host's UCX: a GPU-less host keeps the list as given
    here = _memory.device_kinds_here()
    assert parse_options({"tls": tls}, environ={}).tls == (f"{given},cuda" if "cuda" in here else given)
    # the probe agrees with a context that selects every transport (UCX's default)
    assert ("cuda" in here) == ("cuda" in _memory_types(lib, {}))


def test_the_cuda_memory_type_follows_the_transport_list(lib):
    """The defect itself: under ``tcp`` the context reports no CUDA memory, under the list
    ``device_memory`` resolves (``tcp,cuda``) it does."""
    if "cuda" not in _memory.device_kinds_here():
        pytest.skip("UCX has no CUDA transports on this host (no CUDA driver): it reports no CUDA memory "
                    f"under any transport list (default list: {_memory_types(lib, {})})")
    for tls in ("tcp", "cma+tcp", "shm"):
        given = TLS_ALIASES[tls]
        assert "cuda" not in _memory_types(lib, {"TLS": given}), given
        resolved = parse_options({"tls": tls, "device_memory": "cuda"}, environ={}).ucx_settings()["TLS"]
        assert "cuda" in _memory_types(lib, {"TLS": resolved}), resolved


@pytest.mark.parametrize("env", ["tcp", "cma,tcp", "sysv,posix,cma", "^cuda", "^cuda_copy,ib"])
def test_a_user_ucx_tls_without_cuda_transports_is_refused_naming_it(lib, monkeypatch, env):
    monkeypatch.setenv("UCX_TLS", env)
    with pytest.raises(errors.BackendOptionError) as ei:
        kvt.open("ucx", device_memory="cuda")  # the real open path reads the process environment
    msg = str(ei.value)
    assert f"UCX_TLS={env!r}" in msg and "device_memory='cuda'" in msg, msg
    fix = f"UCX_TLS={env},cuda" if not env.startswith("^") else "out of UCX_TLS"
    assert fix in msg and "unset UCX_TLS" in msg and "tls=" in msg, msg
    # with the option given, the environment is not consulted: the list is ours to extend
    assert parse_options({"tls": "tcp", "device_memory": "cuda"}, environ={"UCX_TLS": env}).tls == "tcp,cuda"


@pytest.mark.parametrize("env", ["tcp,cuda", "tcp,cuda_copy", "^rc", "all"])
def test_a_user_ucx_tls_with_cuda_transports_is_left_to_ucx(lib, monkeypatch, env):
    monkeypatch.setenv("UCX_TLS", env)
    opts = parse_options({"device_memory": "cuda"})  # the backend's own call: os.environ
    assert opts.tls is None and "TLS" not in opts.ucx_settings()  # UCX reads UCX_TLS itself


@pytest.mark.parametrize("options,named", [({"tls": "^cuda"}, "tls"), ({"tls": "^tcp,cuda_copy"}, "tls"),
                                           ({"ucx_config": {"TLS": "^cuda"}}, "ucx_config TLS")])
def test_a_deny_list_excluding_cuda_is_refused_with_device_memory(options, named):
    with pytest.raises(errors.BackendOptionError, match=f"needs UCX's cuda transports, but {named} "):
        parse_options({**options, "device_memory": "cuda"}, environ={})


def test_device_memory_in_ucx_config_tls_is_extended_there():
    opts = parse_options({"ucx_config": {"TLS": "tcp"}, "device_memory": "cuda"}, environ={})
    assert opts.ucx_settings()["TLS"] == "tcp,cuda"


def test_device_memory_option_is_checked():
    with pytest.raises(errors.BackendOptionError, match="device_memory must be one of"):
        parse_options({"device_memory": "gpu"}, environ={})


def test_register_names_the_transport_list_or_the_driver_real_context():
    """Subprocess (unmapped 'device' address: any CPU access would be a SIGSEGV): a real agent
    whose list leaves cuda out. On a GPU host the refusal names the transport list and the fix;
    on a GPU-less one it names the missing driver, not the list."""
    _ucx_usable()
    code = textwrap.dedent(f"""
        import os
        os.environ.pop("UCX_TLS", None)
        import kvtransport as kvt
        from kvtransport import errors
        from kvtransport_ucx.memory import UcxDeviceTransportsExcluded, device_kinds_here
        print("cuda here", "cuda" in device_kinds_here())
        with kvt.open("ucx", tls="tcp", device_memory="none") as a:
            try:
                a.register(({UNMAPPED}, 1 << 20), kind="cuda", device=0)
                print("ACCEPTED")
            except errors.UnsupportedMemoryKindError as e:
                print(type(e).__name__, "|", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "UCX_TLS"})
    assert out.returncode == 0, f"rc={out.returncode}\n{out.stdout}\n{out.stderr}"
    here, refusal = out.stdout.splitlines()[:2]
    if here == "cuda here True":
        assert refusal.startswith("UcxDeviceTransportsExcluded |"), refusal
        assert "leaves them out" in refusal and "device_memory='cuda'" in refusal and "tls='tcp,cuda'" in refusal
    else:
        assert refusal.startswith("UcxMemoryKindUnavailable |"), refusal
        assert "CUDA driver" in refusal and "leaves them out" not in refusal, refusal
