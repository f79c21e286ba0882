"""The H100 acceptance trace: long-context multi-turn sessions sized so each mode runs in about a minute.

python reports/engine/make_trace.py OUT.jsonl [--sessions N --first TOKENS --later TOKENS --out-tokens N]
"""
import argparse

import numpy as np

from tangram.traces.format import Trace, Turn, save_trace

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--sessions", type=int, default=16)
p.add_argument("--turns", type=int, default=3)
p.add_argument("--first", type=int, default=8000)
p.add_argument("--later", type=int, default=256)
p.add_argument("--out-tokens", type=int, default=128)
p.add_argument("--spread-s", type=float, default=4.0)
p.add_argument("--think-s", type=float, default=1.0)
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()
rng = np.random.default_rng(a.seed)
turns = []
arr = np.sort(rng.uniform(0, a.spread_s, a.sessions))
for s in range(a.sessions):
    sid = f"s{s:03d}"
    first = int(a.first * rng.uniform(0.75, 1.25))
    for t in range(a.turns):
        new = first if t == 0 else int(a.later * rng.uniform(0.5, 1.5))
        out = int(a.out_tokens * rng.uniform(0.5, 1.5))
        turns.append(Turn(f"{sid}:{t}", sid, t, float(arr[s]) if t == 0 else None,
                          0.0 if t == 0 else float(a.think_s * rng.uniform(0.5, 1.5)), new, out))
save_trace(Trace(turns), a.out)
print(f"wrote {a.out}: {a.sessions} sessions x {a.turns} turns")
