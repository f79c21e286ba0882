"""Why a replay advances step by step: every scheduled single step of one ``tangram-sim`` run, by what it did
(admitted a turn, ran prefill chunks, evicted) and by why the fast-forward planner declined to run ahead before it.

A replay's time is ~1.3 ms of Python a event (a single step or a run of steps, docs/simulator.md), so the number
of single steps bounds what fast-forwarding can still save. ``Scheduler.plan_run`` declines while the queue's head
could be admitted at the next step, among others (``Scheduler.declined``):

* ``head not blocked``: no failed admission of the head yet (it is tried at the next step, or the step's chunks
  leave no token budget to try it);
* ``freed since``: the head failed before, but pages were freed since (a finished turn), so the next try may pass;
* ``idle sessions``: a finished turn parked its session since the head's failed try (the next try evicts it);
* ``head changed``: another turn is at the head of the queue.

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

    def plan_run_counted(self, max_steps=None):
        r = plan_run(self, max_steps)
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

    S.Scheduler.plan_run, S.Scheduler.schedule = plan_run_counted, schedule_counted
    try:
        sim_main(argv)
    except SystemExit as e:
        if e.code:
            return int(e.code)
    finally:
        S.Scheduler.plan_run, S.Scheduler.schedule = plan_run, schedule
    for k, v in sorted(steps.items(), key=lambda kv: -kv[1]):
        print(f"{v:8d}  {k}", file=sys.stderr)
    print(json.dumps({"single_steps": sum(steps.values()), "plan_run": dict(declined), "steps": dict(steps)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
