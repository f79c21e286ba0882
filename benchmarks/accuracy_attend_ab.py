"""Another checkout's ``EvalAttention._attend`` against this one's, alternated in one process (same model, same
samples, one torch thread): CPU seconds of KVzip's first-chunk scoring and of whole report jobs, and whether the
outputs are equal bit for bit. Cheaper and less noisy than two processes on a shared 2-core machine.

Run: ``python -P benchmarks/accuracy_attend_ab.py --old /tmp/old  [--reps 4] [--curve 12] [--jobs ...]`` where
``/tmp/old`` holds the other checkout's ``tangram`` (e.g. ``git archive BASE tangram | tar -x -C /tmp/old``).
Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="folder holding the other checkout's tangram/ package")
    ap.add_argument("--reps", type=int, default=4, help="KVzip first chunks per variant (niah_single, 1,024 tokens)")
    ap.add_argument("--curve", type=int, default=12, help="curve samples per variant (full cache only)")
    ap.add_argument("--jobs", default="", help="report jobs, e.g. task:vt:21:1024,kl:21 (all 237 modes)")
    ap.add_argument("--micro", action="store_true",
                    help="also time the attention's parts alone on SmolLM2's shapes (ms a layer call, bfloat16)")
    ns = ap.parse_args(argv)
    import torch
    if ns.micro:
        print(json.dumps({"micro_ms": micro()}), flush=True)

    from tangram.config import get_model
    from tangram.profiles import evaluate as E
    from tangram.profiles.accuracy_report import _resolve_lists, build_parser, job_options, profile_dirs
    path = Path(ns.old) / "tangram" / "profiles" / "evaluate.py"
    spec = importlib.util.spec_from_file_location("old_evaluate", path)
    old = importlib.util.module_from_spec(spec)
    sys.modules["old_evaluate"] = old  # dataclasses look their module up
    spec.loader.exec_module(old)
    variants = {"old": old.EvalAttention._attend, "new": E.EvalAttention._attend}
    torch.set_num_threads(1)
    args = build_parser().parse_args(["--tasks", "passkey=512", "--curve", "", "--calibrate-missing", "0"])
    lists = _resolve_lists(args)
    cfg = get_model(args.model)
    modes, _ = E.build_modes(cfg.num_layers, cfg.num_kv_heads, lists["scorers"], lists["scopes"], lists["rhos"],
                             lists["alphas"], E.ProfileStore(cfg.name, profile_dirs(args.profiles, Path(args.out))))
    E.init_worker(args.model, args.weights, 1, modes, job_options(args))
    tok, model = E._W["tok"], E._W["task_model"]

    def order(i: int):
        return ("old", "new") if i % 2 == 0 else ("new", "old")

    out: dict = {"old_path": str(path), "kvzip_cpu_s": {"old": [], "new": []}, "curve_cpu_s": {"old": [], "new": []},
                 "jobs": {}, "equal": True}
    s = E.build_task_sample(tok, "niah_single", "heldout", 30, 1024, 2)
    ids = E.prompt_ids(tok, s, 0)
    kv_modes = [E.Mode("full"), E.Mode("dynamic", "kvzip", "per-layer", 0.5)]
    scores = {}
    for i in range(ns.reps):
        for name in order(i):
            E.EvalAttention._attend = variants[name]
            sc, _, _, sco = E.first_chunk(model, kv_modes, ids[:2048], None, tok)
            out["kvzip_cpu_s"][name].append(round(sc["kvzip"].cpu_seconds, 3))
            scores.setdefault(name, sco["kvzip"])
    if scores:
        out["equal"] &= bool(torch.equal(scores["old"], scores["new"]))

    def run(job, name):
        E.EvalAttention._attend = variants[name]
        c = time.process_time()
        r = E.run_job(job)
        return r, time.process_time() - c

    def same(a: dict, b: dict) -> bool:
        keys = [k for k in ("correct", "first_wrong", "kept", "kl", "top1") if k in a]
        import numpy as np
        return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k]), equal_nan=True) for k in keys)

    E._W["modes"] = modes
    for i in range(ns.curve):
        task, length = [("niah_single", 1024), ("vt", 1024), ("passkey", 512)][i % 3]
        res = {}
        for name in order(i):
            res[name], dt = run(("curve", task, 40 + i, length), name)
            out["curve_cpu_s"][name].append(round(dt, 3))
        out["equal"] &= same(res["old"], res["new"])
    for i, j in enumerate(x for x in ns.jobs.split(",") if x):
        p = j.split(":")
        job = ("kl", int(p[1])) if p[0] == "kl" else (p[0], p[1], int(p[2]), int(p[3]))
        res, t = {}, {}
        for name in order(i):
            res[name], t[name] = run(job, name)
        out["jobs"][j] = {k: round(v, 3) for k, v in t.items()}
        out["equal"] &= same(res["old"], res["new"])
    for k in ("kvzip_cpu_s", "curve_cpu_s"):
        v = out[k]
        if v["old"]:
            out[k + "_mean"] = {n: round(statistics.fmean(x), 3) for n, x in v.items()}
    print(json.dumps(out))
    return 0 if out["equal"] else 1


def micro(reps: int = 10) -> dict:
    """Milliseconds a layer call (one thread, bfloat16, 9 query / 3 KV heads of 64): the explicit [rows, query
    heads, queries, keys] bias, the broadcast causal one and SDPA, for KVzip's repeat over a 1,024-token first chunk
    (1 row, 1,050 queries over 2,074 keys) and for 24 rows of 9 answer queries over a 1,024-token cache (their bias,
    the K/V concatenation that appends the new keys, SDPA)."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(1)

    def ms(f) -> float:
        f()
        t = time.perf_counter()
        for _ in range(reps):
            f()
        return round((time.perf_counter() - t) / reps * 1e3, 3)

    out = {}
    for name, (R, T, N, evicted) in {"kvzip_repeat": (1, 1050, 2074, False), "rows_answer": (24, 9, 1033, True)}.items():
        Hq, Hkv, D = 9, 3, 64
        g, dt = Hq // Hkv, torch.bfloat16
        q = torch.randn(R, Hq, T, D, dtype=dt)
        K, V = torch.randn(R, Hkv, N, D, dtype=dt), torch.randn(R, Hkv, N, D, dtype=dt)
        keep = torch.rand(R, Hkv, N) < 0.5 if evicted else torch.ones(R, Hkv, N, dtype=torch.bool)
        pos, qp = torch.arange(N), torch.arange(N - T, N)

        def explicit():
            allowed = keep[:, :, None, :] & (pos[None, None, None, :] <= qp[None, None, :, None])
            return torch.zeros(allowed.shape, dtype=dt).masked_fill_(~allowed, float("-inf")).repeat_interleave(g, 1)

        def causal():
            allowed = pos[None, None, None, :] <= qp[None, None, :, None]
            return torch.zeros(allowed.shape, dtype=dt).masked_fill_(~allowed, float("-inf"))

        bias = explicit()
        row = {"explicit_bias": ms(explicit),
               "sdpa": ms(lambda: F.scaled_dot_product_attention(q, K, V, attn_mask=bias, enable_gqa=True))}
        if not evicted:
            row["broadcast_causal_bias"] = ms(causal)
        else:
            prefix, new = K[:1, :, :N - T].expand(R, -1, -1, -1), K[:, :, N - T:]
            row["kv_concatenation"] = 2 * ms(lambda: torch.cat([prefix, new], dim=2))
        out[name] = row
    return out


if __name__ == "__main__":
    sys.exit(main())
