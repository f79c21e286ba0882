"""Why a replay advances step by step: every scheduled single step of one ``tangram-sim`` run, by what it did
(admitted a turn, ran prefill chunks, evicted) and by why the fast-forward planner declined to run ahead before it;
and the runs it did commit, by length.

A replay's time is ~1.3 ms of Python a event (a single step or a run of steps, docs/simulator.md), so the number
of single steps bounds what fast-forwarding can still save. ``Scheduler.plan_run`` declines while the queue's head
could be admitted at the next step, among others (``Scheduler.declined``):

* ``head not blocked``: no failed admission of the head yet (it is tried at the next step, or the step's chunks
  leave no token budget to try it);
* ``freed since``: the head failed before, but pages were freed since (a finished turn), so the next try may pass;
* ``idle sessions``: a finished turn parked its session since the head's failed try (the next try evicts it);
* ``head changed``: another turn is at the head of the queue;
* ``too short``: the run would be one step (``tangram.harness.cluster.MIN_RUN_STEPS``), taken as a single step;
* ``chunks not reserved``: a turn prefills whose chunks take their pages as they run (the dynamic mode) and it is
  not one turn whose chunk waits for pages that making room cannot free (``Scheduler._stalled``).

Run: ``python benchmarks/sim_step_causes.py TRACE [tangram-sim options...]`` (e.g. ``--mode tangram``); last
line: one JSON object (counts). The wrapped methods change nothing: the run's outputs are those of ``tangram-sim``.
"""
from __future__ import annotations

import collections
import json
import sys


def main(argv: list[str]) -> int:
    from tangram import scheduler as S
    from tangram.sim.cli import main as sim_main

    declined: collections.Counter = collections.Counter()
    steps: collections.Counter = collections.Counter()
    plan_run, schedule = S.Scheduler.plan_run, S.Scheduler.schedule

    def plan_run_counted(self, max_steps=None, min_steps=1):
        r = plan_run(self, max_steps, min_steps)
        declined["ran ahead" if r is not None else self.declined] += 1
        self._asked = True
        return r

    def schedule_counted(self):
        reason = self.declined if getattr(self, "_asked", False) else "not asked (fast-forward off)"
        self._asked = False
        p = schedule(self)
        c = p.counters
        what = ("admitted" if c.get("admitted") else "no admission") + (", prefill" if p.num_prefill else "") \
            + (", evicted" if c.get("evicted") else "")
        steps[f"{what} | after: {reason}"] += 1
        return p

    runs: list[tuple[int, int, bool]] = []  # (steps planned, steps committed, carries a prefill chunk)

    def commit_run_counted(self, run, j):
        runs.append((run.k, j, bool(run.num_prefill.any())))
        return commit_run(self, run, j)

    commit_run = S.Scheduler.commit_run
    S.Scheduler.plan_run, S.Scheduler.schedule = plan_run_counted, schedule_counted
    S.Scheduler.commit_run = commit_run_counted
    try:
        sim_main(argv)
    except SystemExit as e:
        if e.code:
            return int(e.code)
    finally:
        S.Scheduler.plan_run, S.Scheduler.schedule, S.Scheduler.commit_run = plan_run, schedule, commit_run
    for k, v in sorted(steps.items(), key=lambda kv: -kv[1]):
        print(f"{v:8d}  {k}", file=sys.stderr)
    print(json.dumps({"single_steps": sum(steps.values()), "plan_run": dict(declined), "steps": dict(steps),
                      "runs": run_lengths(runs)}))
    return 0


def run_lengths(runs: list[tuple[int, int, bool]]) -> dict:
    """The committed runs by length (steps committed): how many, how many carry a chunk, the steps they cover."""
    bins = [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 64), (65, None)]
    out = {"runs": len(runs), "steps": sum(j for _, j, _ in runs), "cut_short": sum(1 for k, j, _ in runs if j < k)}
    for lo, hi in bins:
        sel = [(j, c) for _, j, c in runs if j >= lo and (hi is None or j <= hi)]
        label = str(lo) if hi == lo else f"{lo}+" if hi is None else f"{lo}-{hi}"
        out[label] = {"runs": len(sel), "with_chunks": sum(c for _, c in sel), "steps": sum(j for j, _ in sel)}
    return out


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
