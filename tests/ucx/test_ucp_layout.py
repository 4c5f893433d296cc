"""The ctypes structures in ``kvtransport_ucx.ucp`` match the C headers byte for byte.

A wrong offset in a UCX parameter struct does not fail loudly: UCX reads garbage for a
field and misbehaves later. This test compiles a tiny C program against the headers shipped
with the libucx wheel and compares ``sizeof``/``offsetof`` of every field we declare.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvtransport.testing.required import skip_or_fail

_ucp = pytest.importorskip("kvtransport_ucx.ucp")


def _include_dir() -> Path:
    try:
        import libucx
    except ImportError as exc:  # fails instead of skipping where ucx is required (CI)
        skip_or_fail("ucx", f"the libucx wheel is not installed ({exc}); pip install 'kvtransport[ucx]'")
    inc = Path(libucx.__file__).parent / "include"
    if not (inc / "ucp" / "api" / "ucp.h").exists():
        pytest.skip(f"UCX headers not found under {inc}")
    return inc


def test_struct_layouts_match_headers(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc/gcc) on PATH to check struct layouts against the headers")
    inc = _include_dir()
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <ucp/api/ucp.h>", "int main(void){"]
    expected: list[str] = []
    for cname, cls in _ucp.LAYOUT.items():
        lines.append(f'printf("{cname} size %zu\\n", sizeof({cname}));')
        expected.append(f"{cname} size {__import__('ctypes').sizeof(cls)}")
        for fname, *_ in cls._fields_:
            lines.append(f'printf("{cname}.{fname} %zu\\n", offsetof({cname}, {fname}));')
            expected.append(f"{cname}.{fname} {getattr(cls, fname).offset}")
    lines.append("return 0;}")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run([cc, "-I", str(inc), str(src), "-o", str(exe)], check=True, capture_output=True)
    got = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    assert [g for g in got if g] == expected


def test_library_loads_and_reports_version() -> None:
    lib = _ucp.lib()
    major, minor, _ = (int(x) for x in lib.version().split("."))
    assert (major, minor) >= (1, 11)
    assert lib.status_string(_ucp.UCS_ERR_UNREACHABLE)  # non-empty text from libucs


def test_ptr_status_decodes_errors() -> None:
    assert _ucp.ptr_status(None) == _ucp.UCS_OK
    assert _ucp.ptr_status(0x7F0000001000) == _ucp.UCS_INPROGRESS
    assert _ucp.ptr_status((1 << 64) + _ucp.UCS_ERR_CANCELED) == _ucp.UCS_ERR_CANCELED
