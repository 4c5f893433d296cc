import os
import sys

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "vllm"))
sys.path.insert(0, HERE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_addoption(parser):
    g = parser.getgroup("kvtransport soak")
    g.addoption("--soak-requests", type=int, default=None,
                help="long soak: requests per (mode, topology) case instead of the short CI figure")
    g.addoption("--soak-seed", type=int, default=1, help="seed of every RNG of the soak")
