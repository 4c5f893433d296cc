"""tests/vllm033 runs only against vLLM 0.33 (``scripts/dev.sh test`` runs it in its own
venv, .venv-vllm033, after the main suite; a venv that cannot be built fails that run).

Under any other vLLM (the main venv's 0.32 CPU build) these files are not collected: they
check 0.33's own layout resolution, planner and allocator, which is what they are for.
The 0.32 suite's harnesses (tests/vllm) are imported, not copied.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import PackageNotFoundError, version

#: the vLLM release this directory checks
VLLM_RELEASE = "0.33"


def _installed() -> str:
    try:
        return version("vllm")
    except PackageNotFoundError:
        return ""


if not _installed().startswith(VLLM_RELEASE + "."):
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "vllm"))
    sys.path.insert(0, os.path.dirname(__file__))
