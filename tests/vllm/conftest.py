import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Side-channel secret of every engine built by these tests: see harness.TEST_SECRET.
os.environ.setdefault("KVTRANSPORT_SECRET", "kvtransport-test-cluster-secret")
sys.path.insert(0, os.path.dirname(__file__))
