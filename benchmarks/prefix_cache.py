"""Shared prefixes in the simulator: each mode on a Mooncake-like trace, with its ``prefix`` chains and without.

The trace imitates what the Mooncake importer finds in the FAST'25 traces (docs/traces.md): every request starts
with the same 512-token system block; most sessions ask about one of a few documents of 2-6 blocks of 512 tokens
(Zipf popularity), so several hundred requests share a document; some sessions branch: their first turn continues
another session's first turn and answer (its chain covers that history, which the parent's next turn declares too).
Same arguments, same trace (numpy ``default_rng(seed)``). Writes ``trace.jsonl``, ``results.json`` and
``results.md`` to ``--out``; ``reports/prefix_cache/run.sh`` is the command behind the committed numbers.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from tangram.config import EngineConfig, get_gpu, get_model
from tangram.traces import Trace, Turn, save_trace

SYS = ("sys", 512)


def mooncake_like(sessions: int, rate: float, seed: int, docs: int = 12, doc_share: float = 0.7,
                  branch_share: float = 0.15) -> Trace:
    rng = np.random.default_rng(seed)
    doc_blocks = rng.integers(2, 7, size=docs)
    pop = 1.0 / np.arange(1, docs + 1) ** 1.1
    pop /= pop.sum()
    t, turns, first = 0.0, [], {}  # first: session -> (chain, prompt, output) of its turn 0
    for i in range(sessions):
        sid = f"s{i}"
        t += float(rng.exponential(1.0 / rate))
        chain = [SYS]
        if rng.random() < doc_share:
            d = int(rng.choice(docs, p=pop))
            chain.append((f"doc{d}", int(doc_blocks[d]) * 512))
        own = int(np.clip(rng.lognormal(np.log(600), 0.8), 16, 6000))
        out = int(np.clip(rng.lognormal(np.log(200), 0.6), 8, 1000))
        parent = None
        if first and rng.random() < branch_share:  # continue an earlier session's first turn (a branch)
            parent = list(first)[int(rng.integers(len(first)))]
        if parent is not None:
            pchain, pprompt, pout = first[parent]
            hist = (f"hist:{parent}", pprompt + pout - sum(n for _, n in pchain))
            chain = list(pchain) + [hist]
        prompt = sum(n for _, n in chain) + own
        turns.append(Turn(f"{sid}:0", sid, 0, round(t, 3), 0.0, prompt, out, prefix=tuple(chain)))
        first[sid] = (tuple(chain), prompt, out)
        k = int(rng.integers(1, 4))  # later turns: follow-ups; the first declares the history branches share
        for j in range(1, k):
            tc = tuple(chain) + ((f"hist:{sid}", prompt + out - sum(n for _, n in chain)),) if j == 1 else tuple(chain)
            turns.append(Turn(f"{sid}:{j}", sid, j, None, float(np.round(rng.lognormal(np.log(5), 0.8), 3)),
                              int(np.clip(rng.lognormal(np.log(150), 0.6), 20, 800)),
                              int(np.clip(rng.lognormal(np.log(150), 0.6), 8, 800)), prefix=tc))
    return Trace(turns, f"benchmarks/prefix_cache.py mooncake_like({sessions}, {rate}, {seed})")


def strip(trace: Trace) -> Trace:
    return Trace([replace(t, prefix=()) for t in trace.turns], trace.source + " without prefix")


def main(argv=None) -> None:
    from tangram.sim.run import simulate
    from tangram.spec import DeploymentSpec, default_profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=400)
    ap.add_argument("--rate", type=float, default=2.0, help="session arrivals per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="full,uniform,dynamic,br,br+rp,tangram")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--tables", default="auto", help="cost tables folder ('none': roofline)")
    ap.add_argument("--out", default="reports/prefix_cache")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tr = mooncake_like(a.sessions, a.rate, a.seed)
    save_trace(tr, out / "trace.jsonl")
    model, gpu, eng = get_model(a.model), get_gpu(a.gpu), EngineConfig()
    spec = DeploymentSpec(model, gpu, eng, default_profile(model, eng.rho, eng.alpha, a.seed), seed=a.seed,
                   tables=None if a.tables == "none" else a.tables)
    keys = ["completed", "throughput_rps", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
            "busy_s", "preemptions", "session_evictions", "prefix_hit_rate_requests", "prefix_hit_rate_tokens",
            "prefix_tokens_saved", "prefix_shared_pages_peak", "prefix_cached_pages_peak", "prefix_page_copies"]
    rows = {}
    for mode in a.modes.split(","):
        for label, t in (("no sharing", strip(tr)), ("sharing", tr)):
            t0 = time.perf_counter()
            summ, _ = simulate(t, spec, mode, record_kv=False)
            rows[f"{mode}, {label}"] = {k: summ.get(k) for k in keys}
            print(f"{mode:8s} {label:10s} {summ['throughput_rps']:.4g} req/s  ttft p50 {summ['ttft_p50_s']:.3g} s  "
                  f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    (out / "results.json").write_text(json.dumps({"command": " ".join(["python benchmarks/prefix_cache.py"]
                                                                       + (argv or sys.argv[1:])),
                                                  "trace": tr.source, "results": rows}, indent=1) + "\n")
    from tangram.metrics import markdown_table

    n_pref = sum(1 for x in tr.turns if x.prefix)
    head = (f"{len(tr.turns)} turns in {tr.num_sessions} sessions, {n_pref} declaring a prefix; "
            f"{model.name} on {gpu.name}, EngineConfig() defaults\n\n")
    (out / "results.md").write_text(head + markdown_table(rows, keys))
    print((out / "results.md").read_text())


if __name__ == "__main__":
    main()
