"""Producer engine of the soak in its own process (so the soak can SIGKILL and restart it).

Argument: one JSON object {"extra": kv_connector_extra_config, "sc_faults": {...},
"block_size": n, "num_blocks": n}. Commands on stdin, one JSON object per line:
``{"cmd": "add", "rid", "prompt"}``, ``{"cmd": "abort", "rid"}``, ``{"cmd": "drain",
"timeout"}``, ``{"cmd": "quit"}``. Output lines: ``{"params": {rid: kv_transfer_params}}``,
``{"ended": [rid]}`` (aborted before its prefill finished), ``{"faults": {...}}`` (cumulative,
whenever the counts changed: the soak SIGKILLs this process, often within half a second of its
first step, and counts it had not written yet would be lost), ``{"report": {...}}`` (after drain: leaks), ``{"error": traceback}`` (an
exception escaped the engine step: the soak counts it as a violation).
"""

import json
import queue
import sys
import threading
import time
import traceback

from soak_harness import SideChannelFaults

from harness import Engine
from vllm.v1.request import RequestStatus


def main() -> None:
    args = json.loads(sys.argv[1])
    sc = SideChannelFaults(**args["sc_faults"])
    P = Engine("kv_producer", args["extra"], engine_id="P", block_size=args["block_size"],
               num_blocks=args["num_blocks"], max_num_batched_tokens=1024, transmit=sc.transmit)
    w = P.worker._worker
    cmds: queue.Queue = queue.Queue()

    def reader() -> None:
        for line in sys.stdin:
            cmds.put(json.loads(line))
        cmds.put({"cmd": "quit"})

    threading.Thread(target=reader, daemon=True).start()

    def out(**msg) -> None:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()

    def faults() -> dict:
        f = {f"core_{k}": v for k, v in (w.agent.faults.plan.injected if w.agent.faults else {}).items()}
        f.update(sc.counts)
        return f

    sent_faults = None
    drain_until = None
    while True:
        try:
            while True:
                c = cmds.get_nowait()
                if c["cmd"] == "add":
                    P.add(c["rid"], c["prompt"], 1, {"do_remote_decode": True})
                elif c["cmd"] == "abort":
                    st = P.status(c["rid"])
                    if st is not None and not RequestStatus.is_finished(st):
                        P.abort(c["rid"])
                        out(ended=[c["rid"]])
                elif c["cmd"] == "drain":
                    drain_until = time.monotonic() + float(c["timeout"])
                elif c["cmd"] == "quit":
                    P.close()
                    return
        except queue.Empty:
            pass
        try:
            params = P.step()
        except Exception:
            out(error=traceback.format_exc())
            raise
        P.outputs.clear()
        P.kv_outputs.clear()
        P.scheduled_log.clear()
        if params:
            out(params=params)
        sc.flush()
        now = time.monotonic()
        f = faults()
        if f != sent_faults:
            sent_faults = f
            out(faults=f)
        if drain_until is not None and ((not P.scheduler.requests and not w.producer.holds) or now > drain_until):
            st = w.agent.stats()
            out(report={"producer_blocks": P.free0 - P.free_blocks(), "producer_pending": st["pending"],
                        "producer_unquiesced": st["unquiesced"], "producer_holds": len(w.producer.holds),
                        "producer_requests": len(P.scheduler.requests), "faults": faults()})
            drain_until = None
        if not P.scheduler.requests:
            time.sleep(0.002)


if __name__ == "__main__":
    main()
