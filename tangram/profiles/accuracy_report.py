"""``tangram-accuracy``: task accuracy and KL of every serving mode on the real model, with confidence intervals.

Runs the generated tasks of :mod:`tangram.profiles.tasks` (and documentation text for KL) through SmolLM2
under the full cache and, per scorer and ratio, uniform, the method's own dynamic selection at each budget
scope, tangram's static budgets, and dynamic/uniform at tangram's kept share (memory-matched). Writes
``report.md``, PNG plots, ``results.json`` (every per-sample outcome) and the accuracy table the simulator
and the tuner read (``accuracy_<model>.json``).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tangram.errors import ConfigError
from tangram.cli import Parser, check_at_least, cli_main, output_dir
from tangram.profiles import stats
from tangram.profiles.accuracy import AccuracyTable
from tangram.profiles.evaluate import NUMERICS, NUMERICS_DEFAULT, SCOPES, Mode, job_numerics
from tangram.profiles.tasks import task_version

HEADLINE_TURN = 1  # mt_niah's headline is its first follow-up turn (index 1): the question-agnostic case
LENGTH_FLOOR = 0.8  # a task's length is the longest whose full-cache accuracy provably clears this (choose_length)


def _pairs(text: str, what: str) -> dict[str, int | None]:
    """TASK[=TOKENS] list; a task without =TOKENS gets its length from the curve (None)."""
    from tangram.profiles.tasks import TASKS
    if text.strip() == "all":
        return {t: None for t in TASKS}
    out: dict[str, int | None] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        k, sep, v = part.partition("=")
        try:
            out[k.strip()] = int(v) if sep else None
        except ValueError:
            raise ConfigError(f"{what}: expected TASK[=TOKENS],... got {part!r}") from None
        if sep and out[k.strip()] < 1:
            raise ConfigError(f"{what}: {k.strip()}'s length must be >= 1 token, got {part!r}")
    return out


def choose_length(points: dict[int, list[list[bool]]], floor: float = LENGTH_FLOOR,
                  confidence: float = stats.CONFIDENCE) -> dict:
    """A task's context length from its full-cache curve: the longest measured length at which every reported
    outcome of the task (mt_niah: its first turn and its follow-up) has a Wilson lower bound >= ``floor``.

    ``points``: length -> per outcome, the full cache's verdicts on the curve's samples (drawn from a split the
    report does not use, so the reported full-cache accuracy at the chosen length is not the one it was chosen
    on). A lower bound, not the point estimate: with 20 samples a length at 85% can be a 76% task (it was). When
    no length clears the floor, the one with the highest lower bound is returned with ``passed`` False (the
    report says so). Returns {"length", "passed", "lower_bound" (of the chosen length), "bounds" (per length)}."""
    if not points:
        raise ConfigError("choose_length: no curve points")
    bounds = {}
    for n, outs in points.items():
        lbs = [stats.wilson(int(np.sum(o)), len(o), confidence)[0] if len(o) else float("nan") for o in outs]
        bounds[int(n)] = float(np.min(lbs)) if lbs and not np.isnan(lbs).any() else float("nan")
    ok = [n for n, b in bounds.items() if b >= floor]
    if ok:
        n = max(ok)
        return {"length": n, "passed": True, "lower_bound": bounds[n], "bounds": bounds}
    finite = {n: b for n, b in bounds.items() if np.isfinite(b)}
    if not finite:
        raise ConfigError("choose_length: no curve point has samples")
    best = max(finite.values())
    n = max(k for k, b in finite.items() if b == best)
    return {"length": n, "passed": False, "lower_bound": best, "bounds": bounds}


def curve_points(rows: list[dict]) -> dict[str, dict[int, list[list[bool]]]]:
    """Curve samples -> task -> length -> per reported outcome (every turn) the verdicts, by sample index."""
    by: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        by.setdefault((r["task"], int(r["length"])), []).append(r)
    out: dict[str, dict[int, list[list[bool]]]] = {}
    for (t, n), rs in by.items():
        rs = sorted(rs, key=lambda r: r["index"])
        turns = len(rs[0]["correct"][0])
        out.setdefault(t, {})[n] = [[bool(r["correct"][0][k]) for r in rs] for k in range(turns)]
    return out


def _floats(text: str, what: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what}: expected numbers separated by commas, got {text!r}") from None
    if not all(math.isfinite(x) for x in out):
        raise ConfigError(f"{what}: expected finite numbers, got {text!r}")
    return out


def _lengths(text: str, what: str) -> list[int]:
    """Token counts: positive whole numbers (``1e3`` is 1000, ``100.7`` is refused, not truncated)."""
    vals = _floats(text, what)
    if any(v < 1 or v != int(v) for v in vals):
        raise ConfigError(f"{what}: expected whole token counts >= 1, got {text!r}")
    return [int(v) for v in vals]


def profile_dirs(profiles: str | None, out: Path) -> list[str]:
    """The folders searched for budget profiles: ``--profiles`` (each must exist: a typo would otherwise send
    the run into calibrating every profile again) or the package's shipped ones, then OUT/profiles."""
    from tangram.profiles.registry import DATA_DIR
    if profiles is None:
        return [str(DATA_DIR), str(Path(out) / "profiles")]
    dirs = [d.strip() for d in profiles.split(",") if d.strip()]
    for d in dirs:
        if not Path(d).is_dir():
            raise ConfigError(f"--profiles: {d} is not a folder")
    return dirs + [str(Path(out) / "profiles")]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="tangram-accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weights", default="auto")
    p.add_argument("--tasks", default="all",
                   help="TASK[=CONTEXT_TOKENS] list or 'all' (first-turn prompt length; a task without one gets "
                        "the longest curve length whose full-cache accuracy clears --length-floor, see "
                        "choose_length)")
    p.add_argument("--length-floor", type=float, default=LENGTH_FLOOR,
                   help="full-cache accuracy the 95%% Wilson lower bound must clear at a chosen length")
    p.add_argument("--curve-split", default="calib",
                   help="split of the curve's samples (not the report's, so the chosen length is checked afresh)")
    p.add_argument("--samples", type=int, default=100, help="samples per task (every mode sees the same ones)")
    p.add_argument("--turns", type=int, default=2, help="turns of the multi-turn task (2-4)")
    p.add_argument("--scorers", default="all", help="comma list of scoring methods, or 'all' registered ones")
    p.add_argument("--scopes", default="all", help=f"comma list of budget scopes ({', '.join(SCOPES)}) or 'all'")
    p.add_argument("--rhos", default="0.75,0.5,0.25,0.1", help="target kept shares")
    p.add_argument("--alphas", default="2", help="tangram safety margins (eq. 5), e.g. 2 or 2,0")
    p.add_argument("--no-matched", action="store_true",
                   help="skip the dynamic/uniform controls at tangram's kept share")
    p.add_argument("--kl-samples", type=int, default=100, help="documentation passages for KL (0: none)")
    p.add_argument("--kl-context", type=int, default=512, help="context tokens of a KL passage")
    p.add_argument("--kl-continuation", type=int, default=16, help="continuation tokens scored by KL")
    p.add_argument("--curve", default="256,512,768,1024",
                   help="context lengths of the full-cache accuracy curve ('' to skip)")
    p.add_argument("--curve-samples", type=int, default=100)
    p.add_argument("--chunk-size", type=int, default=2048, help="prefill chunk C (the engine's default)")
    p.add_argument("--window", type=int, default=None, help="scorers' observation window (default theirs)")
    p.add_argument("--batch", type=int, default=24, help="modes evaluated together as batch rows")
    p.add_argument("--dtype", default=NUMERICS_DEFAULT, choices=list(NUMERICS),
                   help="numerics of the task runs (KL and calibration always run in float32): "
                        + "; ".join(f"{k}: {v}" for k, v in NUMERICS.items()))
    p.add_argument("--dtype-check", type=int, default=10,
                   help="with --dtype other than float32, also run the full cache in float32 on this many "
                        "samples per task")
    p.add_argument("--workers", type=int, default=2, help="processes (each loads the model)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--profiles", default=None,
                   help="comma list of folders with budget profiles (default: the shipped ones, "
                        "tangram/profiles/data of the installed package; OUT/profiles is searched too)")
    p.add_argument("--calibrate-missing", type=int, default=50,
                   help="calibrate profiles that no folder has on this many scbench-synth calib samples "
                        "(0: skip those tangram rows)")
    p.add_argument("--calib-context-tokens", type=int, default=1024)
    p.add_argument("--split", default="heldout")
    p.add_argument("--table", default=None,
                   help="where to write the accuracy table (default OUT/accuracy_<model>.json)")
    p.add_argument("--report-only", action="store_true", help="rebuild the report from OUT/results.json")
    p.add_argument("--fresh", action="store_true",
                   help="ignore OUT/partial.jsonl (by default a rerun of the same configuration resumes from it)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("-o", "--out", default="reports/fidelity")
    return p


def _resolve_lists(args) -> dict:
    from tangram.profiles.scoring import METHODS
    from tangram.profiles.tasks import TASKS
    tasks = _pairs(args.tasks, "--tasks")
    for t in tasks:
        if t not in TASKS:
            raise ConfigError(f"--tasks: unknown task {t!r}; choose from {', '.join(TASKS)}")
    scorers = list(METHODS) if args.scorers.strip() == "all" else [s.strip() for s in args.scorers.split(",") if s.strip()]
    for s in scorers:
        if s not in METHODS:
            raise ConfigError(f"--scorers: unknown scoring method {s!r}; registered: {', '.join(METHODS)}")
    scopes = list(SCOPES) if args.scopes.strip() == "all" else [s.strip() for s in args.scopes.split(",") if s.strip()]
    for s in scopes:
        if s not in SCOPES:
            raise ConfigError(f"--scopes: unknown scope {s!r}; choose from {', '.join(SCOPES)}")
    rhos, alphas = _floats(args.rhos, "--rhos"), _floats(args.alphas, "--alphas")
    if not rhos or any(not 0 < r < 1 for r in rhos):
        raise ConfigError(f"--rhos must be ratios in (0, 1), got {args.rhos!r}")
    if not alphas or any(a < 0 for a in alphas):
        raise ConfigError(f"--alphas must be margins >= 0, got {args.alphas!r}")
    curve = sorted(set(_lengths(args.curve, "--curve"))) if args.curve.strip() else []
    if any(n is None for n in tasks.values()) and not (curve and args.curve_samples > 0):
        raise ConfigError("--tasks: a task without =TOKENS needs the curve to choose its length "
                          "(--curve and --curve-samples > 0)")
    if not 0 < args.length_floor < 1:
        raise ConfigError(f"--length-floor must be in (0, 1), got {args.length_floor}")
    check_at_least(("--samples", args.samples, 0), ("--kl-samples", args.kl_samples, 0),
                   ("--curve-samples", args.curve_samples, 0), ("--batch", args.batch, 1),
                   ("--workers", args.workers, 1))
    if not 2 <= args.turns <= 4:
        raise ConfigError(f"--turns must be 2..4, got {args.turns}")
    return {"tasks": tasks, "scorers": scorers, "scopes": scopes, "rhos": rhos, "alphas": alphas, "curve": curve}


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _mode_dict(m: Mode) -> dict:
    return {"key": m.key, "policy": m.policy, "scorer": m.scorer, "scope": m.scope, "rho": m.rho, "alpha": m.alpha,
            "matched_to": m.match_label, "profile": m.profile,
            "mean_B": None if m.budgets is None else float(np.mean(m.budgets)),
            "budgets": None if m.budgets is None else np.round(m.budgets, 6).tolist()}


# --------------------------------------------------------------------------- running


def job_options(args) -> dict:
    """What a worker needs to run a job (part of partial.jsonl's fingerprint: a change re-measures every sample)."""
    return {"split": args.split, "turns": args.turns, "chunk": args.chunk_size, "batch": args.batch,
            "window": args.window, "kl_context": args.kl_context, "kl_continuation": args.kl_continuation,
            "calib_context": args.calib_context_tokens, "dtype": args.dtype, "dtype_check": args.dtype_check,
            "curve_split": args.curve_split, "doc_text": doc_text_digest()}


def doc_text_digest() -> str:
    """The shipped documentation text's digest (tasks.DOC_TOPICS): samples drawn from another text are never
    reused (before it was shipped, each Python drew its own haystacks)."""
    import hashlib

    from tangram.profiles.tasks import DOC_TOPICS
    return hashlib.sha1(DOC_TOPICS.read_bytes()).hexdigest()[:12]


def run(args, lists: dict, out: Path) -> dict:
    from tangram.config import get_model
    from tangram.profiles.evaluate import ProfileStore, build_modes, run_jobs, write_profiles
    cfg = get_model(args.model)
    L, H = cfg.num_layers, cfg.num_kv_heads
    t_start = time.time()
    timings = {}
    dirs = profile_dirs(args.profiles, out)
    opts = job_options(args)
    common = dict(workers=args.workers, threads=args.threads, model_name=args.model, weights=args.weights,
                  progress=not args.no_progress)
    store = ProfileStore(cfg.name, dirs)
    modes, notes = build_modes(L, H, lists["scorers"], lists["scopes"], lists["rhos"], lists["alphas"], store,
                               matched=not args.no_matched)
    calibrated = []
    missing = sorted({(s, sc, r) for s in lists["scorers"] for sc in lists["scopes"] if sc != "uniform"
                      and not (s == "pyramidkv" and sc == "cross-layer")  # no such mode (check_method_scope)
                      for r in lists["rhos"] if store.get(s, sc, r) is None})
    if missing and args.calibrate_missing > 0:
        needs: dict[str, set[str]] = {}
        for s, sc, _ in missing:
            needs.setdefault(s, set()).add(sc)
        o = dict(opts, calib_needs=needs, calib_rhos=sorted({r for *_, r in missing}))
        t0 = time.time()
        acc: dict = {}
        for res in run_jobs([("calib", i) for i in range(args.calibrate_missing)], modes=[], opts=o,
                            desc="calibrate missing profiles", **common):
            for k, v in res["retention"].items():
                if k in missing:
                    acc.setdefault(k, []).append(v)
        prov = {"corpus": "scbench-synth", "split": "calib", "samples": args.calibrate_missing,
                "context_tokens": args.calib_context_tokens, "chunk_size": args.chunk_size, "unit": "chunk",
                "window": args.window, "weights": args.weights, "synthetic": False,
                "command": "tangram-accuracy (calibration of missing profiles)",
                "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        calibrated = write_profiles(acc, 2.0, cfg.name, out / "profiles", prov)
        timings["calibration_s"] = round(time.time() - t0, 1)
        store = ProfileStore(cfg.name, dirs)
        modes, notes = build_modes(L, H, lists["scorers"], lists["scopes"], lists["rhos"], lists["alphas"], store,
                                   matched=not args.no_matched)
    raw = {"curve": [], "task": [], "kl": []}
    t0 = time.time()
    # Every finished sample is appended to OUT/partial*.jsonl; a rerun of the same configuration resumes from it.
    # The curve (full cache only) does not depend on the modes, so it has its own file and fingerprint.
    same = {"model": args.model, "weights": args.weights, **{k: opts[k] for k in ("split", "turns", "chunk", "window",
                                                                               "dtype", "doc_text")}}
    books = {"curve": _Book(out / "partial_curve.jsonl", dict(same, split=args.curve_split), args.fresh, args.dtype),
             "main": _Book(out / "partial.jsonl", dict(same, modes=[m.key for m in modes], opts=opts), args.fresh,
                           args.dtype)}
    for b in books.values():
        for r in b.done.values():
            raw[r["kind"]].append(r)
    timings["resumed_samples"] = sum(len(b.done) for b in books.values())
    cpu = [r.get("cpu_seconds", 0.0) for b in books.values() for r in b.done.values()]

    def run_book(jobs, desc):
        todo = [j for j in jobs if not books["curve" if j[0] == "curve" else "main"].has(j)]
        for res in run_jobs(todo, modes=modes, opts=opts, desc=desc, **common):
            r = _jsonable(res)
            raw[r["kind"]].append(r)
            cpu.append(r.get("cpu_seconds", 0.0))
            books["curve" if r["kind"] == "curve" else "main"].add(r)

    lengths = {}
    try:
        # The curve, longest length first; a task leaves it at the first length that clears the floor (shorter
        # lengths cannot be chosen any more), so a task the model solves at the longest length costs one point.
        undecided = list(lists["tasks"])
        for n in sorted(lists["curve"], reverse=True):
            if not undecided:
                break
            run_book([("curve", t, i, n) for i in range(args.curve_samples) for t in undecided], f"curve {n}")
            pts = curve_points(raw["curve"])
            undecided = [t for t in undecided
                         if not choose_length({n: pts[t][n]}, args.length_floor)["passed"]]
        pts = curve_points(raw["curve"])
        for t, n in lists["tasks"].items():
            if t in pts:
                lengths[t] = dict(choose_length(pts[t], args.length_floor), fixed=n)
        lists["tasks"] = {t: (n if n is not None else lengths[t]["length"]) for t, n in lists["tasks"].items()}
        jobs_main = [("task", t, i, n) for i in range(args.samples) for t, n in lists["tasks"].items()]
        jobs_main += [("kl", i) for i in range(args.kl_samples)]
        run_book(jobs_main, "accuracy")
    finally:
        for b in books.values():
            b.close()
    timings["cpu_seconds"] = round(float(sum(cpu)), 1)
    timings["evaluation_s"] = round(time.time() - t0, 1)
    timings["total_s"] = round(time.time() - t_start, 1)
    per_job = [r["seconds"] for k in ("task", "kl") for r in raw[k]]
    timings["sample_seconds_mean"] = round(float(np.mean(per_job)), 2) if per_job else None
    return {"modes": [_mode_dict(m) for m in modes], "notes": notes, "calibrated_profiles": calibrated,
            "raw": raw, "timings": timings, "lengths": lengths}


class _Book:
    """Append-only record of finished samples, valid for one configuration fingerprint. ``numerics``: the task
    model's (``--dtype``); a row is reused only if computed in the numerics its job runs in now (task and curve
    rows: ``numerics``; KL: float32) and on the task's current definition (``TASK_VERSIONS``): both are part of
    the row's key (``_job_of``) and checked on the row itself, so a file merged from runs of other numerics or
    task versions never feeds them into this one."""

    def __init__(self, path: Path, fingerprint: dict, fresh: bool, numerics: str = NUMERICS_DEFAULT):
        self.path, self.fp = path, json.dumps(fingerprint, sort_keys=True, default=str)
        self.numerics = numerics
        self.done: dict[str, dict] = {}
        if path.is_file() and not fresh:
            lines = path.read_text().splitlines()
            if lines and json.loads(lines[0]).get("fingerprint") == self.fp:
                for ln in lines[1:]:
                    try:
                        d = json.loads(ln)
                    except json.JSONDecodeError:  # a line cut by a kill
                        continue
                    r = d["result"]
                    if r.get("kind") in ("task", "curve") and r.get("task_version", 1) != task_version(r["task"]):
                        continue  # measured on an earlier definition of the task: measured again
                    if _numerics_of(r) != job_numerics(r.get("kind"), numerics):
                        continue  # computed in other numerics: measured again
                    self.done[json.dumps(_job_of(r))] = r
        self.f = None

    def has(self, job: tuple) -> bool:
        return json.dumps(_versioned(list(job), job_numerics(job[0], self.numerics))) in self.done

    def add(self, r: dict) -> None:
        if self.f is None:
            self.f = open(self.path, "a" if self.done else "w")
            if not self.done:
                self.f.write(json.dumps({"fingerprint": self.fp}) + "\n")
        self.f.write(json.dumps({"job": _job_of(r), "result": r}) + "\n")
        self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def _numerics_of(r: dict) -> str:
    """The numerics a result row was computed in; rows from before the label are bfloat16 task/curve rows and
    float32 KL/calibration rows (what those runs computed them in)."""
    return r.get("numerics") or job_numerics(r.get("kind"), NUMERICS_DEFAULT)


def _versioned(job: list, numerics: str) -> list:
    """A job's resume key. It names the task's definition when it is not the first, and the numerics the
    sample was computed in when they are not what that kind of job was computed in before the label existed
    (bfloat16 tasks, float32 KL), so rows of earlier definitions or other numerics never match."""
    key = list(job)
    if job[0] in ("task", "curve") and task_version(job[1]) > 1:
        key.append(f"v{task_version(job[1])}")
    if numerics != job_numerics(job[0], NUMERICS_DEFAULT):
        key.append(f"numerics={numerics}")
    return key


def _job_of(r: dict) -> list:
    if r["kind"] in ("task", "curve"):
        return _versioned([r["kind"], r["task"], r["index"], r["length"]], _numerics_of(r))
    return _versioned([r["kind"], r["index"]], _numerics_of(r))


def _jsonable(res: dict) -> dict:
    out = {}
    for k, v in res.items():
        if isinstance(v, np.ndarray):
            if v.dtype == bool:
                out[k] = v.astype(int).tolist()
            else:
                x = np.round(v.astype(np.float64), 6)
                out[k] = np.where(np.isfinite(x), x, None).tolist()
        elif isinstance(v, dict) and k == "retention":
            out[k] = v
        else:
            out[k] = v
    return out


# --------------------------------------------------------------------------- aggregation


def aggregate(res: dict, tasks: dict[str, int]) -> dict:
    """Cells (task, mode key) -> per-sample outcomes, and the summary rows of the accuracy table."""
    modes = res["modes"]
    keys = [m["key"] for m in modes]
    outcomes: dict[str, dict[str, np.ndarray]] = {}  # task label -> key -> [n] 0/1 (sorted by sample index)
    kept: dict[str, list[float]] = {k: [] for k in keys}
    prompt_len: dict[str, list[int]] = {}
    for t in tasks:
        rows = sorted((r for r in res["raw"]["task"] if r["task"] == t), key=lambda r: r["index"])
        if not rows:
            continue
        c = np.array([r["correct"] for r in rows], dtype=bool)  # [n, M, turns]
        prompt_len[t] = [r["prompt_tokens"] for r in rows]
        if t == "mt_niah":
            for turn in range(c.shape[2]):
                lab = "mt_niah" if turn == HEADLINE_TURN else f"mt_niah turn {turn + 1}"
                outcomes[lab] = {k: c[:, i, turn] for i, k in enumerate(keys)}
        else:
            outcomes[t] = {k: c[:, i, 0] for i, k in enumerate(keys)}
        kk = np.array([r["kept"] for r in rows], dtype=np.float64)
        for i, k in enumerate(keys):
            kept[k].extend(kk[:, i].tolist())
    kl_rows = sorted(res["raw"]["kl"], key=lambda r: r["index"])
    kl = {k: np.array([r["kl"][i] for r in kl_rows]) for i, k in enumerate(keys)} if kl_rows else {}
    top1 = {k: np.array([r["top1"][i] for r in kl_rows]) for i, k in enumerate(keys)} if kl_rows else {}
    headline = [t if t != "mt_niah" else "mt_niah" for t in tasks if t in outcomes or t == "mt_niah"]
    headline = [t for t in headline if t in outcomes]
    kv = {k: float(np.nanmean(v)) if v else float("nan") for k, v in kept.items()}
    rows = []
    for m in modes:
        k = m["key"]
        base = {"policy": m["policy"], "scorer": m["scorer"], "scope": m["scope"], "rho": m["rho"],
                "alpha": m["alpha"], "matched_to": m["matched_to"], "kv_share": round(kv[k], 6)}
        for t in outcomes:
            x = outcomes[t][k]
            lo, hi = stats.wilson(int(x.sum()), x.size)
            rows.append(dict(base, task=t, metric="accuracy", value=float(x.mean()), ci_low=lo, ci_high=hi,
                             ci_method="wilson", n=int(x.size)))
        if headline:
            v, lo, hi = stats.stratified_mean([outcomes[t][k] for t in headline], seed=1)
            rows.append(dict(base, task="mean", metric="accuracy", value=v, ci_low=lo, ci_high=hi,
                             ci_method="stratified-bootstrap-percentile", n=int(sum(outcomes[t][k].size
                                                                                   for t in headline))))
        if kl:
            lo, hi = stats.bootstrap_mean(kl[k], seed=2)
            rows.append(dict(base, task="kl_text", metric="kl", value=float(kl[k].mean()), ci_low=lo, ci_high=hi,
                             ci_method="bootstrap-percentile", n=int(kl[k].size)))
            lo, hi = stats.bootstrap_mean(top1[k], seed=3)
            rows.append(dict(base, task="kl_text", metric="top1_agreement", value=float(top1[k].mean()),
                             ci_low=lo, ci_high=hi, ci_method="bootstrap-percentile", n=int(top1[k].size)))
    return {"outcomes": outcomes, "headline": headline, "kv": kv, "kl": kl, "top1": top1, "rows": rows,
            "prompt_len": prompt_len}


def comparisons(res: dict, agg: dict) -> list[dict]:
    """Paired differences of tangram against its controls, per task and for the task mean."""
    modes = {m["key"]: m for m in res["modes"]}
    out = []
    for m in modes.values():
        if m["policy"] != "tangram":
            continue
        s, sc, r, a = m["scorer"], m["scope"], m["rho"], m["alpha"]
        lab = f"tangram a={a:g}"
        ctrl = {}
        for c in modes.values():
            if c["scorer"] != s or c["rho"] != r:
                continue
            if c["policy"] == "dynamic" and c["scope"] == sc and c["matched_to"] == lab:
                ctrl["dynamic, same KV bytes"] = c
            if c["policy"] == "uniform" and c["matched_to"] == f"{lab} {sc}":
                ctrl["uniform, same KV bytes"] = c
            if c["policy"] == "dynamic" and c["scope"] == sc and c["matched_to"] is None:
                ctrl["dynamic, same rho" if a > 0 else "dynamic, same KV bytes"] = c
            if c["policy"] == "uniform" and c["matched_to"] is None:
                ctrl["uniform, same rho" if a > 0 else "uniform, same KV bytes"] = c
        for what, c in ctrl.items():
            row = {"scorer": s, "scope": sc, "rho": r, "alpha": a, "control": what, "tangram": m["key"],
                   "other": c["key"], "kv_tangram": agg["kv"][m["key"]], "kv_other": agg["kv"][c["key"]],
                   "tasks": {}}
            for t, o in agg["outcomes"].items():
                d, lo, hi = stats.paired_difference(o[m["key"]], o[c["key"]], seed=4)
                row["tasks"][t] = {"tangram": float(o[m["key"]].mean()), "other": float(o[c["key"]].mean()),
                                   "diff": d, "ci_low": lo, "ci_high": hi, "n": int(o[m["key"]].size)}
            if agg["headline"]:
                diffs = [agg["outcomes"][t][m["key"]].astype(float) - agg["outcomes"][t][c["key"]]
                         for t in agg["headline"]]
                d, lo, hi = stats.stratified_mean(diffs, seed=5)
                row["mean"] = {"diff": d, "ci_low": lo, "ci_high": hi}
            if agg["kl"]:
                d, lo, hi = stats.paired_difference(agg["kl"][m["key"]], agg["kl"][c["key"]], seed=6)
                row["kl"] = {"diff": d, "ci_low": lo, "ci_high": hi}
            out.append(row)
    return out


def accuracy_table(res: dict, agg: dict, meta: dict) -> AccuracyTable:
    tasks = {t: {"context_tokens": n, "prompt_tokens_mean": float(np.mean(agg["prompt_len"].get(t, [np.nan]))),
                 "samples": len(agg["prompt_len"].get(t, [])),
                 "metric": "exact match of the greedy answer (teacher-forced), word boundary after it"}
             for t, n in meta["tasks"].items()}
    prov = {k: meta[k] for k in ("command", "date", "git_commit", "weights", "split", "chunk_size", "samples",
                                 "kl_samples", "turns", "timings", "machine") if k in meta}
    prov["headline_tasks"] = agg["headline"]
    prov["mean"] = "unweighted mean of the headline tasks' accuracies (mt_niah: its first follow-up turn)"
    return AccuracyTable(meta["model"], agg["rows"], prov, tasks)


# --------------------------------------------------------------------------- report


def _pct(x: float) -> str:
    return "–" if x is None or not np.isfinite(x) else f"{100 * x:.1f}"


def _ci(v, lo, hi) -> str:
    return f"{_pct(v)} [{_pct(lo)}, {_pct(hi)}]"


def _row(rows, **kw) -> dict | None:
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def curve_table(res: dict) -> tuple[list[str], dict]:
    cur: dict[tuple[str, int], list[bool]] = {}
    for r in res["raw"]["curve"]:
        cur.setdefault((r["task"], r["length"]), []).append(bool(r["correct"][0][0]))
        if r["task"] == "mt_niah" and len(r["correct"][0]) > HEADLINE_TURN:
            cur.setdefault(("mt_niah (follow-up)", r["length"]), []).append(bool(r["correct"][0][HEADLINE_TURN]))
    tasks = sorted({t for t, _ in cur}, key=lambda t: (t.startswith("mt"), t))
    lengths = sorted({n for _, n in cur})
    lines = ["| task | " + " | ".join(f"{n} tokens" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for t in tasks:
        cells = []
        for n in lengths:
            x = cur.get((t, n))
            if not x:
                cells.append("–")
                continue
            lo, hi = stats.wilson(sum(x), len(x))
            cells.append(f"{_ci(np.mean(x), lo, hi)} n={len(x)}")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return lines, cur


def plot_curve(cur: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for t in sorted({t for t, _ in cur}):
        ns = sorted(n for tt, n in cur if tt == t)
        y = [np.mean(cur[(t, n)]) for n in ns]
        ci = np.array([stats.wilson(sum(cur[(t, n)]), len(cur[(t, n)])) for n in ns])
        ax.errorbar(ns, y, yerr=[np.array(y) - ci[:, 0], ci[:, 1] - np.array(y)], marker="o", capsize=3, label=t)
    ax.axhline(0.8, color="k", ls="--", lw=0.8)
    ax.set_xlabel("first-turn prompt tokens")
    ax.set_ylabel("full-cache accuracy (95% Wilson CI)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frontier(agg: dict, res: dict, scorer: str, scopes: list[str], path: Path, L: int, H: int) -> None:
    """Accuracy (task mean) and KL vs KV share per scope: the accuracy/memory frontier of one scorer."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tangram.budgets import group_budgets, head_groups
    from tangram.profiles.scoring import budget_tokens
    rows = agg["rows"]
    nsc = [s for s in scopes if s != "uniform"] or ["uniform"]
    metrics = [("accuracy", "mean", "task accuracy, mean of tasks")] + ([("kl", "kl_text", "KL(full || mode), nats")]
                                                                        if agg["kl"] else [])
    fig, axes = plt.subplots(len(metrics), len(nsc), figsize=(5.2 * len(nsc), 3.6 * len(metrics)), squeeze=False)
    full = {met: _row(rows, policy="full", metric=met, task=task) for met, task, _ in metrics}
    T = int(np.mean([n for v in agg["prompt_len"].values() for n in v])) if agg["prompt_len"] else 512
    for j, sc in enumerate(nsc):
        for i, (met, task, ylab) in enumerate(metrics):
            ax = axes[i][j]
            series = [("dynamic", dict(policy="dynamic", scope=sc), "o-"), ("tangram", dict(policy="tangram", scope=sc),
                                                                          "s-"),
                      ("uniform", dict(policy="uniform"), "^-")]
            for name, sel, style in series:
                pts = sorted((r["kv_share"], r["value"], r["ci_low"], r["ci_high"]) for r in rows
                             if r["metric"] == met and r["task"] == task and r["scorer"] == scorer
                             and all(r.get(k) == v for k, v in sel.items()))
                if not pts:
                    continue
                x, y, lo, hi = map(np.array, zip(*pts))
                ax.errorbar(x, y, yerr=[y - lo, hi - y], fmt=style, capsize=2, ms=4, label=name)
            # tangram with ragged pages of H_p = H: same kept tokens, bytes of each group's largest budget
            hp_pts = []
            for m in res["modes"]:
                if m["policy"] == "tangram" and m["scorer"] == scorer and m["scope"] == sc and m["budgets"]:
                    B = np.asarray(m["budgets"])
                    gb = group_budgets(B, head_groups(B, H, True), H)
                    share = float(budget_tokens(gb, T).sum() * H) / (L * H * T)
                    r = _row(rows, metric=met, task=task, **{"policy": "tangram", "scorer": scorer, "scope": sc,
                                                             "rho": m["rho"], "alpha": m["alpha"]})
                    if r:
                        hp_pts.append((share, r["value"]))
            if hp_pts:
                x, y = zip(*sorted(hp_pts))
                ax.plot(x, y, "x:", color="gray", label=f"tangram, reserved pages at H_p={H}")
            f = full[met]
            if f:
                ax.errorbar([1.0], [f["value"]], yerr=[[f["value"] - f["ci_low"]], [f["ci_high"] - f["value"]]],
                            fmt="k*", ms=9, capsize=2, label="full")
            ax.set_xlabel("KV bytes kept (share of the full cache)")
            ax.set_ylabel(ylab)
            ax.set_title(f"{scorer}, {sc} scope", fontsize=9)
            ax.grid(alpha=0.3)
            if met == "kl":
                ax.set_yscale("symlog", linthresh=1e-3)
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _policy_rows(scopes: list[str], alphas: list[float]) -> list[tuple[str, dict]]:
    out = []
    for sc in (s for s in scopes if s != "uniform"):
        for a in alphas:
            out.append((f"{sc} tangram (static, a={a:g})", dict(policy="tangram", scope=sc, alpha=a)))
        out.append((f"{sc} dynamic", dict(policy="dynamic", scope=sc, matched_to=None)))
    if "uniform" in scopes:
        out.append(("uniform", dict(policy="uniform", scope="uniform", matched_to=None)))
    return out


def _matched_rows(lists: dict, uniform: bool) -> list[tuple[str, dict]]:
    out = []
    for a in (a for a in lists["alphas"] if a > 0):
        for sc in (s for s in lists["scopes"] if s != "uniform"):
            out.append((f"dynamic at tangram's KV ({sc}, a={a:g})",
                        dict(policy="dynamic", scope=sc, matched_to=f"tangram a={a:g}")))
        if uniform and "uniform" in lists["scopes"]:
            for sc in (s for s in lists["scopes"] if s != "uniform"):
                out.append((f"uniform at tangram's KV ({sc}, a={a:g})",
                            dict(policy="uniform", matched_to=f"tangram a={a:g} {sc}")))
    return out


def markdown(res: dict, agg: dict, comps: list[dict], meta: dict, lists: dict, curve_lines: list[str]) -> str:
    rows = agg["rows"]
    scorers, rhos = lists["scorers"], lists["rhos"]
    prow = _policy_rows(lists["scopes"], lists["alphas"])
    tm = meta["timings"]
    L = []
    full = _row(rows, policy="full", metric="accuracy", task="mean")
    L += ["# Accuracy of the serving modes on SmolLM2-135M-Instruct (real weights, CPU)", "",
          f"Generated by `{meta['command']}` on {meta['date']} (commit `{meta.get('git_commit') or '?'}`): "
          f"{tm.get('total_s', 0):.0f} s wall on a {meta['machine'].get('cpus', '?')}-CPU machine ({meta['workers']} "
          f"worker processes x {meta['threads']} torch thread; load average before/after: "
          f"{meta['machine'].get('load_before')} / {meta['machine'].get('load_after')})"
          + (f"; {tm['resumed_samples']} samples were resumed from `partial*.jsonl`, computed by an earlier run of "
             "the same configuration, possibly on another machine" if tm.get("resumed_samples") else "") + ".", ""]
    L += ["## Setup", "",
          f"Tasks (generated, seeded, `{meta['split']}` split, {meta['samples']} samples each; every mode sees the "
          "same samples): " + ", ".join(f"`{t}` at {n} tokens" for t, n in meta["tasks"].items()) +
          f". KL: {meta['kl_samples']} Python-documentation passages of {meta['kl_context']} tokens, "
          f"{meta['kl_continuation']} continuation tokens. Prefill chunk C = {meta['chunk_size']} (the engine's "
          "default), so every first-turn prompt is one chunk: each mode compresses it once, after it is computed "
          "(later turns' question chunks are compressed too, as the engine compresses every prefill chunk); "
          "decoded tokens are kept.",
          "",
          "Modes per scorer and target ratio rho: `uniform` (every head keeps ceil(rho T)), `dynamic` (the "
          "method's own per-input selection: per-layer = Ada-KV's layer-wide top-ceil(rho H T), cross-layer = "
          "top-ceil(rho L H T) over all layers), `tangram` (static per-head budgets B = min(1, mu + alpha sigma) "
          "from a calibrated profile of the same scorer and scope; every head keeps top-ceil(B T)), and the "
          "memory-matched controls: `dynamic` and `uniform` keeping exactly as many tokens as tangram does "
          "(tangram's alpha margin keeps more than rho).",
          "",
          "Scoring: exact match of the greedy answer by teacher forcing (the gold answer tokens follow the prompt's "
          "RULER-style answer prefix; correct when every answer position's argmax is the gold token and the next "
          "prediction does not continue the word). CIs are 95%: Wilson for one cell's accuracy, percentile "
          "bootstrap over samples for KL and for paired differences, stratified bootstrap (per task) for the mean "
          "over tasks. The mean is over the headline tasks: " + ", ".join(agg["headline"]) +
          " (`mt_niah` = its first follow-up turn, asked after the context was compressed).", ""]
    if res["notes"]:
        L += ["Profiles: " + "; ".join(res["notes"]), ""]
    if res["calibrated_profiles"]:
        L += [f"Profiles calibrated by this run (missing from the profile folders; {meta['calibrate_missing']} "
              f"scbench-synth `calib` samples, chunk {meta['chunk_size']}, alpha 2): "
              + ", ".join(f"`{Path(p).name}`" for p in res["calibrated_profiles"]), ""]
    fr = {}
    if res["raw"]["task"]:
        fr = _free_summary(res)
        L += [f"Teacher forcing vs free greedy decoding (full cache, first turn, {fr['n']} samples): the "
              f"teacher-forced verdict equals free decoding's 'starts with the answer' on {fr['agree']} of "
              f"{fr['n']}; free decoding 'contains the answer' (RULER's metric) on {fr['contains']} where teacher "
              f"forcing counts {fr['tf']} correct.", ""]
    chk = [(r["full_float32"][0], r["correct"][0][0]) for r in res["raw"]["task"] if "full_float32" in r]
    if chk:
        same = sum(int(a) == int(b) for a, b in chk)
        dt_ = meta.get("dtype")
        L += [f"Precision: task runs in `{dt_}` ({NUMERICS.get(dt_, '?')}; bfloat16 values as the GPU engine "
              f"serves them), KL and calibration in float32. The full cache's first-turn verdict in float32 "
              f"equals the `{dt_}` one on "
              f"{same} of {len(chk)} checked samples ({sum(int(a) for a, _ in chk)} vs "
              f"{sum(int(b) for _, b in chk)} correct).", ""]
    L += ["## Full-cache accuracy vs context length (choosing the lengths)", "",
          f"Full cache only, on the `{meta.get('curve_split', 'calib')}` split (samples the report's tables do not "
          "use). Rule (`choose_length`): a task's length is the longest curve length at which every reported "
          f"outcome of the task (mt_niah: its first turn and its follow-up) has a 95% Wilson lower bound >= "
          f"{meta.get('length_floor', LENGTH_FLOOR):.0%}; the curve is measured longest length first and a task "
          "leaves it at the first length that passes (shorter ones could not be chosen).", ""]
    measured = len(curve_lines) > 2  # a header and its rule: no curve length was measured (--curve '')
    L += (curve_lines if measured else ["No curve was measured (`--curve` empty): the task lengths are the ones "
                                        "`--tasks` fixed."]) + [""]
    for t, c in (res.get("lengths") or {}).items():
        chosen = meta["tasks"].get(t)
        how = (f"fixed at {chosen} by --tasks" if c.get("fixed") is not None else
               f"{chosen} tokens, lower bound {100 * c['lower_bound']:.1f}%" +
               ("" if c["passed"] else f" -- **no measured length clears {meta.get('length_floor', LENGTH_FLOOR):.0%}**"
                " (the highest lower bound is taken)"))
        L.append(f"- `{t}`: {how}")
    L += ["", "![accuracy vs context length](curve.png)", ""] if measured else [""]
    if not agg["outcomes"]:
        return "\n".join(L)
    L += ["## Full cache at the chosen lengths", "", "| task | accuracy [95% CI] | n | prompt tokens |", "|---|---|---|---|"]
    for t in list(agg["outcomes"]):
        r = _row(rows, policy="full", metric="accuracy", task=t)
        pl = agg["prompt_len"].get(t.split(" ")[0], [])
        L.append(f"| {t} | {_ci(r['value'], r['ci_low'], r['ci_high'])} | {r['n']} | "
                 f"{min(pl) if pl else '–'}-{max(pl) if pl else '–'} |")
    if full:
        L.append(f"| **mean** | {_ci(full['value'], full['ci_low'], full['ci_high'])} | {full['n']} | |")
    L += [""]
    # reference-shaped table
    L += ["## Accuracy table (mean over tasks, %), in the shape of the reference RULER table", "",
          "Columns: target kept share rho. Tangram rows keep more than rho (alpha margin); their kept share is "
          "in the per-scorer tables below.", ""]
    head = "| scope / mode | Full | " + " | ".join(f"{s} {int(round(100 * r))}%" for s in scorers for r in rhos) + " |"
    L += [head, "|---|---|" + "---|" * (len(scorers) * len(rhos))]
    for lab, sel in prow:
        cells = []
        for s in scorers:
            for r in rhos:
                x = _row(rows, metric="accuracy", task="mean", scorer=s, rho=r, **sel)
                cells.append(_pct(x["value"]) if x else "–")
        L.append(f"| {lab} | {_pct(full['value']) if full else '–'} | " + " | ".join(cells) + " |")
    L += [""]
    for s in scorers:
        L += [f"### {s}: mean accuracy [95% CI] (KV share kept)", "",
              "| scope / mode | " + " | ".join(f"rho {r:g}" for r in rhos) + " |", "|---|" + "---|" * len(rhos)]
        for lab, sel in prow + _matched_rows(lists, uniform=True):
            cells = []
            for r in rhos:
                x = _row(rows, metric="accuracy", task="mean", scorer=s, rho=r, **sel)
                cells.append(f"{_ci(x['value'], x['ci_low'], x['ci_high'])} ({x['kv_share']:.3f})" if x else "–")
            if any(c != "–" for c in cells):
                L.append(f"| {lab} | " + " | ".join(cells) + " |")
        L += ["", f"![frontier {s}](frontier_{s}.png)", ""]
    # memory-matched comparison
    L += ["## Static budgets vs dynamic selection at equal KV bytes", "",
          "Paired differences (tangram minus control, accuracy points; 95% percentile bootstrap over samples; "
          "mean over tasks: stratified bootstrap). *same KV bytes*: the control keeps exactly as many tokens as "
          "tangram per chunk; *same rho*: the control keeps rho (fewer bytes than tangram).", ""]
    tasks = list(agg["outcomes"])
    L += ["| scorer | scope | rho | control | KV tangram / control | " + " | ".join(tasks) + " | mean | verdict |",
          "|---|---|---|---|---|" + "---|" * len(tasks) + "---|---|"]
    for c in sorted(comps, key=lambda c: (c["scorer"], c["scope"], -c["rho"], c["control"])):
        cells = [f"{100 * v['diff']:+.1f} [{100 * v['ci_low']:+.1f}, {100 * v['ci_high']:+.1f}]"
                 for v in (c["tasks"][t] for t in tasks)]
        mean = c.get("mean")
        mcell = f"{100 * mean['diff']:+.1f} [{100 * mean['ci_low']:+.1f}, {100 * mean['ci_high']:+.1f}]" if mean else "–"
        L.append(f"| {c['scorer']} | {c['scope']} | {c['rho']:g} | {c['control']} | {c['kv_tangram']:.3f} / "
                 f"{c['kv_other']:.3f} | " + " | ".join(cells) + f" | {mcell} | "
                 f"{stats.verdict(mean['ci_low'], mean['ci_high']) if mean else '–'} |")
    L += [""]
    L += _claim_lines(comps)
    # KL
    if agg["kl"]:
        L += ["## KL divergence from the full cache on natural text", "",
              f"Mean over {meta['kl_samples']} passages of KL(full || mode) per continuation token (nats; 95% "
              "percentile bootstrap over passages), and top-1 agreement with the full cache.", ""]
        for s in scorers:
            L += [f"### {s}", "", "| scope / mode | " + " | ".join(f"rho {r:g}" for r in rhos) + " |",
                  "|---|" + "---|" * len(rhos)]
            for lab, sel in prow + _matched_rows(lists, uniform=False):
                cells = []
                for r in rhos:
                    x = _row(rows, metric="kl", task="kl_text", scorer=s, rho=r, **sel)
                    y = _row(rows, metric="top1_agreement", task="kl_text", scorer=s, rho=r, **sel)
                    cells.append(f"{x['value']:.4f} [{x['ci_low']:.4f}, {x['ci_high']:.4f}]; top-1 {_pct(y['value'])}"
                                 if x else "–")
                if any(c != "–" for c in cells):
                    L.append(f"| {lab} | " + " | ".join(cells) + " |")
            L += [""]
    # per task detail
    L += ["## Per task (accuracy % [95% Wilson CI])", ""]
    for s in scorers:
        L += [f"<details><summary>{s}</summary>", ""]
        for t in tasks:
            fr_ = _row(rows, policy="full", metric="accuracy", task=t)
            L += [f"**{t}** (full {_ci(fr_['value'], fr_['ci_low'], fr_['ci_high'])})", "",
                  "| mode | " + " | ".join(f"rho {r:g}" for r in rhos) + " |", "|---|" + "---|" * len(rhos)]
            for lab, sel in prow:
                cells = []
                for r in rhos:
                    x = _row(rows, metric="accuracy", task=t, scorer=s, rho=r, **sel)
                    cells.append(_ci(x["value"], x["ci_low"], x["ci_high"]) if x else "–")
                L.append(f"| {lab} | " + " | ".join(cells) + " |")
            L += [""]
        L += ["</details>", ""]
    cpu_task = [r.get("cpu_seconds") for k in ("task", "kl") for r in res["raw"][k] if r.get("cpu_seconds")]
    L += ["## Cost", "",
          f"Evaluation {tm.get('evaluation_s', 0):.0f} s wall for {len(res['raw']['task'])} task samples, "
          f"{len(res['raw']['kl'])} KL passages and {len(res['raw']['curve'])} curve samples "
          f"({tm.get('resumed_samples', 0)} of them resumed from `partial*.jsonl`, finished by an earlier run of "
          f"the same configuration); {len(res['modes'])} modes per sample"
          + (f"; calibration of missing profiles {tm['calibration_s']:.0f} s" if "calibration_s" in tm else "")
          + ". Wall time depends on what else runs on the machine (load averages above); CPU time does not: "
          f"{tm.get('cpu_seconds', 0):.0f} CPU-s for the evaluated samples"
          + (f", {np.mean(cpu_task):.1f} CPU-s per task or KL sample (all modes)" if cpu_task else "") + ".", "",
          "Raw per-sample outcomes: `results.json`; the accuracy table the simulator and tuner read: "
          f"`{Path(meta['table']).name}`.", ""]
    return "\n".join(L)


def _free_summary(res: dict) -> dict:
    n = agree = contains = tf = 0
    for r in res["raw"]["task"]:
        f = r.get("free")
        if not f:
            continue
        ok = bool(r["correct"][0][0])
        n += 1
        agree += f["prefix"] == ok
        contains += f["contains"]
        tf += ok
    return {"n": n, "agree": agree, "contains": contains, "tf": tf}


def _claim_lines(comps: list[dict]) -> list[str]:
    same = [c for c in comps if c["control"] == "dynamic, same KV bytes" and c.get("mean")]
    if not same:
        return []
    v = [stats.verdict(c["mean"]["ci_low"], c["mean"]["ci_high"]) for c in same]
    n_hi, n_lo, n_eq = v.count("higher"), v.count("lower"), v.count("no significant difference")
    tasks_lower = sorted({(c["scorer"], c["scope"], c["rho"], t) for c in same for t, x in c["tasks"].items()
                          if x["ci_high"] < 0})
    lines = ["**The paper's claim (static budgets match or exceed dynamic selection) at equal KV bytes, on "
             f"SmolLM2-135M:** over {len(same)} (scorer, scope, rho) settings the task-mean difference tangram - "
             f"dynamic is significantly higher in {n_hi}, not significantly different in {n_eq} and significantly "
             f"lower in {n_lo}.", ""]
    if tasks_lower:
        lines += ["Task cells where tangram is significantly lower than dynamic at the same KV bytes: " +
                  ", ".join(f"{s} {sc} rho {r:g} {t}" for s, sc, r, t in tasks_lower) + ".", ""]
    return lines


# --------------------------------------------------------------------------- main


def write_report(res: dict, meta: dict, lists: dict, out: Path) -> None:
    from tangram.config import get_model
    cfg = get_model(meta["model"])
    agg = aggregate(res, meta["tasks"])
    comps = comparisons(res, agg)
    table = accuracy_table(res, agg, meta)
    table.save(meta["table"])
    curve_lines, cur = curve_table(res)
    if cur:
        plot_curve(cur, out / "curve.png")
    for s in lists["scorers"]:
        if any(r["scorer"] == s for r in agg["rows"]):
            plot_frontier(agg, res, s, lists["scopes"], out / f"frontier_{s}.png", cfg.num_layers, cfg.num_kv_heads)
    (out / "comparisons.json").write_text(json.dumps(comps, indent=1) + "\n")
    (out / "report.md").write_text(markdown(res, agg, comps, meta, lists, curve_lines))


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lists = _resolve_lists(args)
    out = output_dir(args.out)
    if args.report_only:
        f = out / "results.json"
        if not f.is_file():
            raise ConfigError(f"--report-only: {f} not found")
        d = json.loads(f.read_text())
        res, meta = d["results"], d["meta"]
        lists = meta["lists"]
    else:
        import os
        load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
        res = run(args, lists, out)
        command = "tangram-accuracy " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
        meta = {"command": command, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "git_commit": _git_commit(), "model": args.model, "weights": args.weights, "split": args.split,
                "tasks": lists["tasks"], "samples": args.samples, "turns": args.turns,
                "kl_samples": args.kl_samples, "kl_context": args.kl_context,
                "kl_continuation": args.kl_continuation, "chunk_size": args.chunk_size, "workers": args.workers,
                "threads": args.threads, "calibrate_missing": args.calibrate_missing, "timings": res["timings"],
                "dtype": args.dtype, "curve_split": args.curve_split, "length_floor": args.length_floor,
                "machine": {"cpus": os.cpu_count(), "load_before": load_before, "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg())},
                "table": str(args.table or out / f"accuracy_{args.model}.json"), "lists": lists}
        (out / "results.json").write_text(json.dumps({"meta": meta, "results": res}) + "\n")
    write_report(res, meta, lists, out)
    print(f"wrote {out / 'report.md'} and {meta['table']} ({res['timings'].get('total_s', 0):.0f} s)")
    return 0


if __name__ == "__main__":
    main()
