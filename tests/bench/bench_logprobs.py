"""Peak memory of the learner's log-prob step at a Qwen3-sized vocabulary: the full ``[B, T, V]``
logits (``forward._head`` then ``batch.logprobs_from_logits`` + ``forward.token_entropy``, as the
learner runs it) against ``learner/logprobs.chunked_logprobs``.

    python tests/bench/bench_logprobs.py [--vocab 151936] [--hidden 512] [--rows 2] [--tokens 512] [--chunk 256]

Each variant runs in its own process: forward (log-probs and entropies), a scalar of both,
backward into the hidden states and the head. Peak anonymous memory (``RssAnon`` sampled every
0.5 ms, from after the inputs exist) is reported in MiB, with the step's seconds. Reported, not
asserted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_STEP = r"""
import json, sys, threading, time
import torch
from jointrl.rl.learner.batch import logprobs_from_logits
from jointrl.rl.learner.forward import token_entropy
from jointrl.rl.learner.logprobs import chunked_logprobs

variant, V, H, B, T, chunk = sys.argv[1], *map(int, sys.argv[2:])
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
weight = (0.02 * torch.randn(V, H, generator=g)).requires_grad_()
ids = torch.randint(0, V, (B, T), generator=g)

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
base, peak, stop = anon(), [0], threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.0005)
t = threading.Thread(target=sample); t.start()
t0 = time.perf_counter()
if variant == "full":
    logits = hidden @ weight.T
    lp, h = logprobs_from_logits(logits, ids), token_entropy(logits)
else:
    lp, h = chunked_logprobs(hidden, weight, ids, chunk=chunk, entropy=True)
(lp.sum() + 0.01 * h.sum()).backward()
dt = time.perf_counter() - t0
stop.set(); t.join()
print(json.dumps({"peak_mib": (max(peak[0], anon()) - base) / 2**20, "s": dt}))
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--chunk", type=int, default=256)
    a = p.parse_args()
    logits_mib = a.rows * a.tokens * a.vocab * 4 / 2**20
    print(f"V={a.vocab} H={a.hidden} B={a.rows} T={a.tokens} chunk={a.chunk}: one [B, T, V] float32 = "
          f"{logits_mib:.0f} MiB, the head's gradient = {a.vocab * a.hidden * 4 / 2**20:.0f} MiB")
    print("| variant | peak RssAnon (MiB) | step (s) |\n|---|---|---|")
    for variant in ("full", "chunked"):
        out = subprocess.run([sys.executable, "-c", _STEP, variant, str(a.vocab), str(a.hidden), str(a.rows),
                              str(a.tokens), str(a.chunk)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {variant} | {r['peak_mib']:.0f} | {r['s']:.2f} |")


if __name__ == "__main__":
    main()
