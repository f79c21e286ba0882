"""CPU seconds of single fidelity-report samples (``tangram-accuracy``'s jobs), optionally under cProfile, and the
equivalence of two runs' results.

``run``: the same modes, options and worker code as ``tangram-accuracy`` (every option of that command is accepted
after ``--``), in this process with one torch thread, for the jobs named by ``--jobs`` (``task:NAME:INDEX:LENGTH``,
``curve:NAME:INDEX:LENGTH`` or ``kl:INDEX``); each finished job is appended to ``--out`` in ``partial.jsonl``'s line
format with its ``cpu_seconds`` (process user + system time, insensitive to other jobs on the cores).
``--cprofile FILE`` writes the cProfile stats (on process time) of all jobs; ``--torch-profile`` prints the torch
ops' self CPU time over all jobs, grouped (GEMM, SDPA, cat, dtype copies, ...).

``compare A B``: two such files (or two ``partial.jsonl``) job by job (a job computed in other numerics, e.g.
``--dtype bfloat16-f32compute`` against ``bfloat16``, is the same job): per-mode task verdicts and first wrong
position must be identical, kept shares and KL equal within ``--rtol`` (relative, 1e-6 by default, with an absolute
floor of 1e-9 for values near zero); prints the largest differences and the CPU seconds of each job side by side.
Exit 1 when they differ.

Example::

    python benchmarks/accuracy_sample_cost.py run --jobs task:passkey:0:512,kl:0 --out /tmp/a.jsonl -- \\
        --tasks passkey=512 --curve ''
    python benchmarks/accuracy_sample_cost.py compare /tmp/a.jsonl /tmp/b.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def _parse_job(s: str) -> tuple:
    p = s.split(":")
    if p[0] in ("task", "curve") and len(p) == 4:
        return (p[0], p[1], int(p[2]), int(p[3]))
    if p[0] == "kl" and len(p) == 2:
        return ("kl", int(p[1]))
    raise SystemExit(f"--jobs: {s!r} is none of task:NAME:INDEX:LENGTH, curve:NAME:INDEX:LENGTH, kl:INDEX")


def run(ns, rest: list[str]) -> int:
    import torch

    from tangram.config import get_model
    from tangram.profiles import evaluate
    from tangram.profiles.accuracy_report import (_job_of, _jsonable, _resolve_lists, build_parser, job_options,
                                                  profile_dirs)
    torch.set_num_threads(1)
    args = build_parser().parse_args(rest)
    lists = _resolve_lists(args)
    cfg = get_model(args.model)
    dirs = profile_dirs(args.profiles, Path(args.out))
    store = evaluate.ProfileStore(cfg.name, dirs)
    modes, _ = evaluate.build_modes(cfg.num_layers, cfg.num_kv_heads, lists["scorers"], lists["scopes"],
                                    lists["rhos"], lists["alphas"], store, matched=not args.no_matched)
    opts = job_options(args)
    evaluate.init_worker(args.model, args.weights, 1, modes, opts)
    jobs = [_parse_job(j) for j in ns.jobs.split(",") if j]
    tprof = None
    if ns.torch_profile:
        from torch.profiler import ProfilerActivity, profile
        tprof = profile(activities=[ProfilerActivity.CPU])
        tprof.__enter__()
    prof = None
    if ns.cprofile:
        import cProfile
        prof = cProfile.Profile(time.process_time)  # CPU time: the cores are shared
    with open(ns.out, "w") as f:
        f.write(json.dumps({"fingerprint": "accuracy_sample_cost", "modes": [m.key for m in modes]}) + "\n")
        for j in jobs:
            t0 = time.time()
            if prof is not None:
                prof.enable()
            res = evaluate.run_job(j)
            if prof is not None:
                prof.disable()
            r = _jsonable(res)
            f.write(json.dumps({"job": _job_of(r), "result": r}) + "\n")
            f.flush()
            print(f"{j}: {r['cpu_seconds']:.2f} CPU-s, {time.time() - t0:.2f} s wall, {len(modes)} modes", flush=True)
    if prof is not None:
        prof.dump_stats(ns.cprofile)
    if tprof is not None:
        tprof.__exit__(None, None, None)
        _print_op_groups(tprof)
    return 0


def _op_group(name: str) -> str:
    if any(s in name for s in ("addmm", "aten::mm", "aten::bmm", "aten::matmul")):
        return "GEMM (mm/bmm)"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "SDPA"
    if name in ("aten::copy_", "aten::_to_copy", "aten::to"):
        return "dtype copies"
    if "softmax" in name:
        return "softmax"
    if name == "aten::cat":
        return "cat"
    if "sort" in name or "topk" in name:
        return "sort/topk"
    return "elementwise/other"


def _print_op_groups(tprof) -> None:
    """Self CPU time of torch ops over all jobs, grouped (``--torch-profile``)."""
    groups: dict[str, float] = {}
    for e in tprof.key_averages():
        g = _op_group(e.key)
        groups[g] = groups.get(g, 0.0) + e.self_cpu_time_total / 1e6
    tot = sum(groups.values()) or 1.0
    for g, v in sorted(groups.items(), key=lambda x: -x[1]):
        print(f"  {g:20s} {v:8.2f} s {100 * v / tot:5.1f}%")


def _load(path: str) -> dict[str, dict]:
    lines = Path(path).read_text().splitlines()
    out = {}
    for ln in lines[1:]:
        try:
            d = json.loads(ln)
        except json.JSONDecodeError:
            continue
        # the numerics label of a job's key (accuracy_report._versioned) is left out: compare matches the same
        # sample computed in two numerics
        out[json.dumps([x for x in d["job"] if not (isinstance(x, str) and x.startswith("numerics="))])] = d["result"]
    return out


def _rel(a, b, floor: float = 1e-9) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    na, nb = np.isnan(a), np.isnan(b)
    if (na != nb).any():
        return float("inf")
    d = np.abs(np.where(na, 0, a) - np.where(nb, 0, b))
    return float((d / np.maximum(np.maximum(np.abs(np.where(na, 0, a)), np.abs(np.where(nb, 0, b))), floor)).max(
        initial=0.0))


def compare(ns) -> int:
    A, B = _load(ns.a), _load(ns.b)
    common = [k for k in A if k in B]
    if not common:
        print("no job in common")
        return 1
    bad = 0
    tot = [0.0, 0.0]
    for k in common:
        a, b = A[k], B[k]
        notes, failed = [], False
        for f in ("correct", "first_wrong"):
            if f in a or f in b:
                if a.get(f) != b.get(f):
                    x, y = np.asarray(a.get(f)), np.asarray(b.get(f))
                    n = int((x != y).sum()) if x.shape == y.shape else -1
                    notes.append(f"{f} differs in {n} of {x.size} entries")
                    failed = True
        for f in ("kept", "kl", "top1"):
            if f in a or f in b:
                r = _rel(a.get(f), b.get(f))
                if r > ns.rtol:
                    notes.append(f"{f} rel diff {r:.2e}")
                    failed = True
                elif r > 0:
                    notes.append(f"{f} max rel diff {r:.1e} (ok)")
        if "free" in a and a.get("free") != b.get("free"):
            notes.append("free decoding differs")
            failed = True
        ok = not failed
        bad += not ok
        ca, cb = a.get("cpu_seconds", 0.0), b.get("cpu_seconds", 0.0)
        tot[0] += ca
        tot[1] += cb
        print(f"{'ok  ' if ok else 'DIFF'} {k}: CPU-s {ca:.2f} -> {cb:.2f} ({ca / max(cb, 1e-9):.2f}x)"
              + ("; " + "; ".join(notes) if notes else ""))
    print(f"{len(common)} jobs, {bad} differ; CPU-s {tot[0]:.1f} -> {tot[1]:.1f} ({tot[0] / max(tot[1], 1e-9):.2f}x), "
          f"per job {tot[0] / len(common):.2f} -> {tot[1] / len(common):.2f}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--jobs", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--cprofile", default=None)
    r.add_argument("--torch-profile", action="store_true", help="print torch ops' self CPU time, grouped")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--rtol", type=float, default=1e-6)
    ns = p.parse_args(argv)
    return run(ns, rest) if ns.cmd == "run" else compare(ns)


if __name__ == "__main__":
    sys.exit(main())
