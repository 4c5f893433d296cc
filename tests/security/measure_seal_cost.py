"""Per-message cost of ``Authenticator.seal`` + ``open`` (not a test: prints figures).

Run: ``.venv/bin/python tests/security/measure_seal_cost.py``. Figures for the current
mechanism live in docs/SECURITY.md; timing targets never live in tests/.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from kvtransport.auth import Authenticator

SECRET = b"measure-seal-cost-secret-0123456789"
#: a worker's side-channel name, as requests are sealed for it
DEST = "10.200.3.17:5601"
SIZES = {"request (300 B)": 300, "Welcome (64 KiB)": 64 * 1024}


def per_message_us(size: int, n: int, rounds: int = 7) -> tuple[float, float]:
    """Median and min over ``rounds`` of the mean seal+open CPU time (this thread) of ``n``
    messages: CPU time, not wall time, so a machine shared with other jobs skews it less."""
    sender, receiver = Authenticator(SECRET, "measure"), Authenticator(SECRET, "measure", max_nonces=1 << 22)
    body = os.urandom(size)
    out = []
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(n):
            receiver.open(sender.seal(body, "req", to=DEST), "req", to=DEST)
        out.append((time.thread_time() - t0) / n * 1e6)
    return statistics.median(out), min(out)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    for label, size in SIZES.items():
        med, best = per_message_us(size, n if size < 4096 else max(n // 10, 50))
        print(f"{label:18s} seal+open: median {med:7.1f} us, best {best:7.1f} us per message")


if __name__ == "__main__":
    main()
