"""Producer process of the two-process test: prefill, print params + per-block digests,
serve the consumer until its blocks are released, print FREED."""

import hashlib
import json
import sys

from harness import Engine, prompt_of, run_until

port, n_tokens = int(sys.argv[1]), int(sys.argv[2])
P = Engine("kv_producer", {"backend": "loopback", "mode": "read", "side_channel_port": port,
                           "transfer_timeout_s": 10, "lease_s": 20}, engine_id="P-proc")
prompt = prompt_of(n_tokens, seed=77)
P.add("p1", prompt, 1, {"do_remote_decode": True})
got: dict = {}
run_until([P], lambda: "p1" in got, on_params=got.update)
params = got["p1"]
digests = [[hashlib.sha256(t[b].numpy().tobytes()).hexdigest() for t in P.kv_caches.values()]
           for b in params["remote_block_ids"]]
params.pop("lease_expires_at", None)
print(json.dumps({"params": params, "digests": digests, "prompt": prompt}), flush=True)
run_until([P], lambda: P.free_blocks() == P.free0, timeout=30)
print("FREED", flush=True)
P.close()
