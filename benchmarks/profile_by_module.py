"""A cProfile file's own time (tottime) summed by where the code lives: each of this project's modules, numpy's
Python wrappers, simpy, builtins by name. A replay's cost is spread over dozens of functions at a few percent each;
summed by module it says which layer of the control plane it sits in.

Run: ``python -m cProfile -o t.prof -m tangram.sim.cli TRACE --mode tangram --no-plots --out DIR``, then
``python benchmarks/profile_by_module.py t.prof [--top 25]``. Last line: one JSON object ({module: seconds},
total seconds and function calls).
"""
from __future__ import annotations

import argparse
import collections
import json
import pstats


def by_module(path: str) -> tuple[collections.Counter, collections.Counter]:
    secs, calls = collections.Counter(), collections.Counter()
    for (file, _line, name), (_cc, nc, tt, _ct, _callers) in pstats.Stats(path).stats.items():
        f = file.replace("\\", "/")
        if "/tangram/" in f or "/sim/" in f:
            key = f.split("/tangram/", 1)[-1] if "/tangram/" in f else "sim/" + f.split("/sim/", 1)[-1]
        elif "numpy" in f:
            key = "numpy (Python wrappers)"
        elif "simpy" in f:
            key = "simpy"
        elif f == "~":
            key = "builtin " + name.split(" of ")[0][:48]
        else:
            key = "other"
        secs[key] += tt
        calls[key] += nc
    return secs, calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prof", help="a cProfile output file")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    secs, calls = by_module(a.prof)
    total = sum(secs.values())
    for k, v in secs.most_common(a.top):
        print(f"{v:8.2f} s {100 * v / total:5.1f}% {calls[k]:>10} calls  {k}")
    print(json.dumps({"total_s": round(total, 3), "calls": sum(calls.values()),
                      "by_module_s": {k: round(v, 3) for k, v in secs.most_common()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
