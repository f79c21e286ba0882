"""Study outputs: best_config.json (a tangram-sim --config file), trials.csv, plots and report.md."""
from __future__ import annotations

import json
import shlex
import warnings
from pathlib import Path

from .objective import Evaluator
from .space import SearchSpace, paper_default_params
from .study import Setup, best_config_dict, choose_best


def _paper_default(study, ev: Evaluator, space: SearchSpace) -> tuple[dict, int | None]:
    """The paper default's metrics: its enqueued trial when present, else a fresh evaluation."""
    from optuna.trial import TrialState

    pd_params = paper_default_params(space)
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.params == pd_params:
            return dict(t.user_attrs), t.number
    return ev(pd_params), None


def _plots(study, setup: Setup, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ovm

    made = []
    load = (lambda t: t.values[0]) if setup.objective == "pareto" else None
    # optuna's default importance evaluator (PED-ANOVA) ranks what makes a given target *low*: the load is maximised,
    # so it reads the negated load (with load itself, importance.png ranked the parameters of the worst trials)
    neg_load = (lambda t: -t.values[0]) if load is not None else None

    def importances():
        with warnings.catch_warnings():  # its "achieve low target values" warning: the negation above handles it
            warnings.filterwarnings("ignore", message=".*achieve low `target` values.*")
            return ovm.plot_param_importances(study, target=neg_load, target_name="load (req/s)")
    jobs = [("history.png", lambda: ovm.plot_optimization_history(study, target=load, target_name="load (req/s)")),
            ("importance.png", importances)]
    if setup.objective == "pareto":
        jobs.insert(0, ("pareto.png", lambda: ovm.plot_pareto_front(
            study, target_names=["sustained load (req/s)", "overflow rate"])))
    for name, fn in jobs:
        try:
            ax = fn()
        except (ValueError, RuntimeError, ZeroDivisionError) as e:  # e.g. importance with < 2 distinct trials
            (out / f"{name}.skipped.txt").write_text(f"{name} not drawn: {e}\n")
            continue
        fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
        fig.set_size_inches(7, 4.5)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)
    return made


def write_outputs(study, ev: Evaluator, space: SearchSpace, setup: Setup, out: Path, url: str, argv: list[str],
                  plots: bool = True) -> list[str]:
    from optuna.trial import TrialState

    from .study import redact

    best = choose_best(study, setup)
    base, base_trial = _paper_default(study, ev, space)
    cfg = best_config_dict(best.params, space, setup, ev.tables)
    (out / "best_config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    (out / "paper_default_config.json").write_text(
        json.dumps(best_config_dict(paper_default_params(space), space, setup, ev.tables), indent=1) + "\n")
    summary = {"study": study.study_name, "storage": redact(url), "setup": setup.as_attrs(),
               "best_trial": best.number, "best_params": best.params, "best_metrics": dict(best.user_attrs),
               "paper_default_trial": base_trial, "paper_default_metrics": base,
               "paper_default_params": paper_default_params(space),
               "load_gain": (best.user_attrs["load_rps"] / base["load_rps"] - 1.0) if base["load_rps"] else None,
               "n_complete": len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))),
               "n_fail": len(study.get_trials(deepcopy=False, states=(TrialState.FAIL,))),
               "pareto_front": [t.number for t in study.best_trials] if setup.objective == "pareto" else None,
               # trials whose capacity search found no limit: the trace is too small to saturate the deployment
               "unsaturated_trials": [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                                      if t.user_attrs.get("saturated") is False],
               "accuracy_source": getattr(ev, "accuracy_label", None)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    df = study.trials_dataframe(attrs=("number", "state", "values" if setup.objective == "pareto" else "value",
                                       "params", "user_attrs", "duration"))
    df.to_csv(out / "trials.csv", index=False)
    files = ["best_config.json", "paper_default_config.json", "summary.json", "trials.csv"]
    pics = _plots(study, setup, out) if plots else []
    files += pics
    _report_md(out, summary, setup, best, base, url, argv, pics, getattr(ev, "accuracy_label", None))
    return files + ["report.md"]


def _acc_cells(m: dict) -> str:
    f = lambda x, fmt: "–" if x is None else format(x, fmt)  # noqa: E731
    return f"{f(m.get('kv_share'), '.3f')} | {f(m.get('accuracy'), '.3f')} | {f(m.get('accuracy_rel'), '.1%')}"


def _accuracy_sentence(bm: dict, setup: Setup, label: str | None) -> str:
    """What accuracy the tuned configuration was tuned at, and on what it stands."""
    if bm.get("profile"):  # the study searched the operating point: the curve of this trial's scorer and scope
        label = (f"measured on {setup.model} at this configuration's operating point (rho, scorer, scope from "
                 f"its parameters), budget profile {bm['profile']}"
                 + (f"; table {setup.accuracy_table}" if getattr(setup, "accuracy_table", None) else ""))
    if bm.get("accuracy") is None:
        return "Accuracy: " + (label or "not measured") + "."
    floor = "" if setup.accuracy_floor is None else (
        f" The accuracy floor was {setup.accuracy_floor:.0%} of the full cache's; the tuned configuration "
        + ("meets it." if (bm.get("accuracy_rel") or 0) >= setup.accuracy_floor - 1e-12 else
           "does NOT meet it (no trial did; the most accurate one is reported)."))
    return (f"Accuracy of the tuned configuration: {bm['accuracy']:.3f} at a KV share of {bm['kv_share']:.3f} "
            f"({bm['accuracy_rel']:.1%} of the full cache's {bm['accuracy_full']:.3f}); {label}." + floor)


_VS = "## Tuned vs the paper default (H_p = {hp}, alpha = 2, other fields default)"


def _report_md(out: Path, s: dict, setup: Setup, best, base: dict, url: str, argv: list[str], pics: list[str],
               acc_label: str | None = None):
    from .study import redact

    bm = best.user_attrs
    argv = [redact(a) if "://" in a else a for a in argv]
    gain = s["load_gain"]
    lines = [
        f"# tangram-tune: study `{s['study']}`", "",
        "Command:", "", "```", "tangram-tune " + shlex.join(argv), "```", "",
        f"Storage: `{redact(url)}`; {s['n_complete']} completed trials, {s['n_fail']} failed (killed trials are "
        f"failed by heartbeat and retried).", "",
        f"Setup: model {setup.model}, GPU {setup.gpu}, trace `{setup.trace}`, SLO `{setup.slo}`, objective "
        f"{setup.objective} (overflow bound {setup.overflow_bound:g}), seed {setup.seed}, "
        f"{'single simulation per trial (--objective-fast)' if setup.fast else 'capacity search per trial'}"
        f"{'' if setup.fast else ' (bracket width %g)' % setup.capacity_tol}.", "",
        _VS.format(hp=s.get("paper_default_params", {}).get("heads_per_group", 4)), "",
        "| config | load (req/s) | overflow (weighted) | overflow (unweighted) | lost share | KV kept | "
        "accuracy (measured) | of full cache |", "|---|---|---|---|---|---|---|---|",
        f"| tuned (trial {best.number}) | {bm['load_rps']:.4g} | {bm['overflow']:.4g} | "
        f"{bm['overflow_unweighted']:.4g} | {bm['lost_share']:.4g} | {_acc_cells(bm)} |",
        f"| paper default{'' if s['paper_default_trial'] is None else ' (trial %d)' % s['paper_default_trial']} | "
        f"{base['load_rps']:.4g} | {base['overflow']:.4g} | {base['overflow_unweighted']:.4g} | "
        f"{base['lost_share']:.4g} | {_acc_cells(base)} |", "",
        _accuracy_sentence(bm, setup, acc_label), "",
        (f"The tuned configuration sustains {gain * 100:+.1f}% load vs the paper default under the same "
         f"{'simulation' if setup.fast else 'capacity search'} and SLO." if gain is not None else
         "The paper default sustains no load under this SLO."), "",
        "Tuned parameters: `" + json.dumps(best.params) + "`", "",
        "Check it with the simulator: `tangram-sim --config best_config.json --capacity` "
        "(`python -m tangram.sim.cli` until the console script is installed).", "",
    ]
    if s["unsaturated_trials"]:
        n = len(s["unsaturated_trials"])
        at = lines.index(_VS.format(hp=s.get("paper_default_params", {}).get("heads_per_group", 4)))
        lines[at:at] = [
            f"**Warning: the trace is too small to saturate {n} of {s['n_complete']} trials' deployments** (trials "
            f"{', '.join(map(str, s['unsaturated_trials'][:20]))}{' ...' if n > 20 else ''}): all its requests "
            "arriving at once still met the SLO, so their load is only a lower bound (the highest rate tested) and "
            "the ranking among them means nothing. Tune on a longer trace (more requests) or a tighter SLO.", ""]
    if s["pareto_front"] is not None:
        lines += [f"Pareto front (trial numbers): {s['pareto_front']}", ""]
    lines += [f"![{p}]({p})" for p in pics]
    (out / "report.md").write_text("\n".join(lines) + "\n")
