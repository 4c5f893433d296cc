import os
import sys

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "vllm"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "ucx"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "soak"))
sys.path.insert(0, HERE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
