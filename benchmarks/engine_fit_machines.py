"""An engine-overhead fit priced against every machine the validation configs were measured on.

python benchmarks/engine_fit_machines.py [--fit DIR] [--machines NAME ...] [--step-scale F] [--out DIR]

``--fit DIR`` is a folder with an ``engine_overhead.json`` (e.g. ``tangram-fit-engine --refit PLANS --out-dir DIR``)
and the ``reference_probe.json`` of the machine it was fitted on; the kernel tables are the shipped H100 ones
(``sim/tables/h100``), with DIR's two files laid over them in a scratch folder (default: the shipped fit itself).
For each measured machine (:data:`MACHINES`: a ``tangram-validate`` folder of ``reports/transfer/device_validation``
with its engine runs, ``validation.csv``, and the machine's ``probe.json``) the seven validation configs are
priced by ``tangram-validate --predict-only --tables SCRATCH --probe FOLDER/probe.json --gpu G`` on the
validation trace, and compared with the measured throughput: error = predicted / measured - 1 per config, the
largest |error| and Kendall's tau (``tangram.tuning.pooling``, the one tangram-validate reports) per machine.
Issue 18's line for a machine the fit was not made on: every |error| <= 5% and tau >= 0.9. A ``*`` marks a config
whose simulated schedule is not the engine's (other session evictions, or steps more than 5% apart). The last line
of output is one JSON object.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
DV = ROOT / "reports/transfer/device_validation"
CONFIGS = sorted(str(p) for p in (ROOT / "reports/validation/configs").glob("*.json")) + \
    [str(ROOT / "reports/tuning/study/best_config.json")]
TRACE = ROOT / "reports/transfer/validation_trace.jsonl"
KV_POOL_GIB = "1.3"
# machine label -> (GPU preset, folder of its measured runs and probe); each folder's device.txt names the GPU uuid
MACHINES = {
    "h100_c9de1c55": ("h100-80gb", DV / "h100_fit_6f8a_on_c9de_2026-11-24"),
    "h100_7fb32f59": ("h100-80gb", DV / "h100_fit_1633_on_7fb3_2026-11-25"),
    "h100_1633b835": ("h100-80gb", DV / "h100_fit_6f8a_on_1633_2026-11-24"),
    "h200_72dbae72": ("h200", DV / "h200_one_decode_model_2026-11-25"),
}
SHORT = {"brrp_hp4_a2": "brrp", "dynamic_a2": "dynamic", "full": "full", "paper_default_hp4_a2": "paper",
         "tangram_hp2_a1": "hp2", "tangram_hp8_a3": "hp8", "best_config": "best_config"}
LAYERED = ("engine_overhead.json", "reference_probe.json")  # what a fit folder lays over the shipped tables


def scratch_tables(fit: Path, into: Path, scale: float = 1.0) -> Path:
    """The shipped H100 tables with ``fit``'s engine overhead and reference probe laid over them; ``scale``
    multiplies every engine-overhead coefficient (every step's executor seconds, the host's scheduler time aside)."""
    from tangram.sim.tables import TABLES_ROOT

    shutil.copytree(TABLES_ROOT / "h100", into)
    for f in LAYERED:
        if not (fit / f).exists():
            raise SystemExit(f"{fit / f}: missing (a fit folder holds {' and '.join(LAYERED)})")
        shutil.copy(fit / f, into / f)
    if scale != 1.0:
        p = into / LAYERED[0]
        d = json.loads(p.read_text())
        for m in d["models"].values():
            m["coefficients"] = {k: v * scale for k, v in m["coefficients"].items()}
        p.write_text(json.dumps(d))
    return into


def price(tables: Path, gpu: str, probe: Path, out: Path) -> pd.DataFrame:
    from tangram.cli import parse
    from tangram.tuning.validate import _parser, run

    argv = [*CONFIGS, "--trace", str(TRACE), "--kv-pool-gib", KV_POOL_GIB, "--gpu", gpu, "--tables", str(tables),
            "--predict-only", "--probe", str(probe), "--out", str(out)]
    with contextlib.redirect_stdout(io.StringIO()):
        run(parse(_parser(), argv))
    return pd.read_csv(out / "predicted.csv")


def machine_row(pred: pd.DataFrame, folder: Path) -> dict:
    from tangram.tuning.pooling import kendall_tau

    v = pd.read_csv(folder / "validation.csv").set_index("config")
    meas, pr = v["throughput_rps_meas"], pred.set_index("config")
    p = pr["throughput_rps_pred"]
    names = [n for n in p.index if n in meas.index]
    err = {n: float(p[n] / meas[n] - 1) for n in names}
    # the schedule: steps and session evictions, simulated vs the engine's (mean over its runs); on this trace a few
    # configs sit where a small change of step time flips the schedule between two branches (README)
    sched = {n: {"steps": [int(pr.at[n, "steps_pred"]), float(v.at[n, "steps_meas"])],
                 "evictions": [int(pr.at[n, "session_evictions_pred"]), float(v.at[n, "session_evictions_meas"])]}
             for n in names}
    return {"errors": err, "max_abs_err": max(abs(e) for e in err.values()),
            "mean_abs_err": sum(abs(e) for e in err.values()) / len(err),
            "kendall_tau": kendall_tau([p[n] for n in names], [meas[n] for n in names]),
            "predicted_rps": {n: float(p[n]) for n in names}, "measured_rps": {n: float(meas[n]) for n in names},
            "schedule": sched, "schedule_differs": [n for n, x in sched.items() if x["evictions"][0] != x["evictions"][1]
                                                     or abs(x["steps"][0] / x["steps"][1] - 1) > 0.05]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", default=None, help="folder with engine_overhead.json + reference_probe.json (default: "
                                                "the shipped sim/tables/h100)")
    ap.add_argument("--machines", nargs="+", choices=sorted(MACHINES), default=list(MACHINES))
    ap.add_argument("--out", help="keep each machine's predicted.csv/json under OUT/<machine>/")
    ap.add_argument("--step-scale", type=float, default=1.0,
                    help="price every step's executor seconds x this (the fit's coefficients scaled): how far a "
                         "prediction moves, and whether its schedule flips, under a step-cost error of that size")
    a = ap.parse_args(argv)
    from tangram.sim.tables import TABLES_ROOT

    fit = Path(a.fit) if a.fit else TABLES_ROOT / "h100"
    result = {"fit": str(fit), "step_scale": a.step_scale, "machines": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tables = scratch_tables(fit, Path(tmp) / "h100", a.step_scale)
        for m in a.machines:
            gpu, folder = MACHINES[m]
            out = Path(a.out) / m if a.out else Path(tmp) / m
            result["machines"][m] = r = machine_row(price(tables, gpu, folder / "probe.json", out), folder)
            cells = " ".join(f"{SHORT.get(n, n)} {100 * e:+.1f}%{'*' if n in r['schedule_differs'] else ''}"
                             for n, e in r["errors"].items())
            print(f"{m}: {cells} | max {100 * r['max_abs_err']:.1f}% mean {100 * r['mean_abs_err']:.1f}% tau {r['kendall_tau']:.2f}", flush=True)
    print("*: the simulated schedule is not the engine's (other session evictions, or steps more than 5% apart)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
