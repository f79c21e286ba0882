"""Trace replay: arrivals, sessions, routing and replicas, generic over the executor.

A replica is a shared :class:`tangram.scheduler.Scheduler` plus any
:class:`tangram.plan.Executor`: the simulator's cost model or the GPU engine's
executor (whose ``duration_s`` is the measured wall time of the step). Nothing
here knows how a step is priced. SimPy is the event loop: its clock advances
by each step's duration (priced or measured), so idle gaps cost nothing;
``realtime=True`` runs it against the wall clock instead.

* First turns arrive open-loop at ``arrival_s``; a later turn becomes ready
  ``think_time_s`` after the previous turn of its session finished (closed loop).
* The router picks a replica per turn: ``round-robin``, ``least-outstanding``
  (fewest unfinished tokens) or ``session-affinity`` (later turns go where the
  session's KV lives; first turns to the least-outstanding replica). A turn
  routed away from the replica holding its session recomputes the history there,
  and the old replica drops the session's KV.
* A rejected turn rejects the rest of its session ("previous turn rejected");
  a session's KV is released (``end_session``) after its last turn.
* Fast-forward: when the executor can price a run of steps at once (``execute_run``, the simulator's cost
  model), a replica whose coming steps only advance its unchanged running set (decode rows and prefill chunks,
  ``Scheduler.plan_run``) goes through the whole run in one event. The run ends at the first finish or completed
  prompt, or before the pool runs short; anything done to the replica from outside while it runs (a turn routed to
  it, a session it holds ended) cuts the run at the step in progress, which completes first, exactly as in the
  step-by-step path. A turn queued behind a run that admits nothing whatever waits (``Scheduler.run_admits_nothing``:
  the queue's head is blocked, or the batch is full) leaves its steps as they are, and the run goes on (an
  overloaded replica's arrivals would otherwise cut most runs). A run of one step is taken step by step
  (:data:`MIN_RUN_STEPS`). ``fast_forward=False`` is that reference path.
* Running ahead: an executor with ``runs_ahead`` (the engine with ``ExecutorOptions.async_steps``) is driven by
  ``launch`` / ``complete``: while a step runs, the scheduler advances past it and the next step is planned and
  launched; the clock advances by each step's measured duration when it completes (``_steps_ahead``).
* ``slo_monitor`` (:class:`tangram.harness.slo.SLOMonitor`): the replay stops as soon as the SLO is certain to be
  missed; the requests left are listed as rejected "stopped early: ..." (so the run does not meet the SLO).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import simpy

from tangram.errors import ConfigError
from tangram.metrics import RequestRecord
from tangram.plan import Executor, StepResult
from tangram.scheduler import Scheduler

ROUTERS = ("round-robin", "least-outstanding", "session-affinity")
# Runs shorter than this go step by step: a run of one step saves nothing over the step it stands for, and replays
# declining them ran faster (the 12,000-request Mooncake-like trace has ~4,200; reports/traces/README.md).
MIN_RUN_STEPS = 2


@dataclass
class ReplicaTrace:
    """What one replica did over time (KV samples after each step; step time per operator)."""

    t: list = field(default_factory=list)
    reserved: list = field(default_factory=list)
    live: list = field(default_factory=list)
    breakdown: dict = field(default_factory=dict)
    steps: int = 0
    busy_s: float = 0.0
    prefill_step_s: float = 0.0
    runs: int = 0  # fast-forwarded runs of steps (their steps are counted in ``steps``)
    run_steps: int = 0


@dataclass
class ClusterResult:
    records: list[RequestRecord]
    replicas: list[ReplicaTrace]
    schedulers: list[Scheduler]
    end_s: float
    stopped: str | None = None  # why the replay stopped early (an SLO certain to be missed), else None

    @property
    def steps(self) -> int:
        return sum(r.steps for r in self.replicas)


class _Replica:
    def __init__(self, idx: int, sched: Scheduler, executor: Executor):
        self.idx, self.sched, self.executor = idx, sched, executor
        self.outstanding = 0
        self.wake: simpy.Event | None = None
        self.trace = ReplicaTrace()
        self.proc: simpy.Process | None = None
        self.in_run = False  # inside a fast-forwarded run that an outside change must cut
        self.ff = hasattr(executor, "execute_run") and hasattr(sched, "plan_run")
        self.ahead = bool(getattr(executor, "runs_ahead", False))  # launch / complete: plans the next step early


class Cluster:
    def __init__(self, trace, replicas: Sequence[tuple[Scheduler, Executor]], router: str = "session-affinity", *,
                 realtime: bool = False, realtime_factor: float = 1.0,
                 progress: Callable[[int], None] | None = None, record_kv: bool = True,
                 fast_forward: bool = True, slo_monitor=None):
        if router not in ROUTERS:
            raise ConfigError(f"unknown router {router!r}; choose from {', '.join(ROUTERS)}")
        if not replicas:
            raise ConfigError("need at least one replica")
        self.turns = list(trace.turns)
        self.router = router
        self.env = simpy.rt.RealtimeEnvironment(factor=realtime_factor, strict=False) if realtime \
            else simpy.Environment()
        self.replicas = [_Replica(i, s, e) for i, (s, e) in enumerate(replicas)]
        self.progress = progress
        self.record_kv = record_kv
        self.fast_forward = fast_forward
        self.monitor = slo_monitor
        self._stop = self.env.event()  # succeeds when the monitor's verdict is certain: ends env.run
        self._stop.callbacks.append(simpy.core.StopSimulation.callback)
        self._rr = 0
        # per-session state: turn indices in order, holder replica, logical context
        self.session_turns: dict[str, list[int]] = {}
        for i, t in enumerate(self.turns):
            self.session_turns.setdefault(t.session_id, []).append(i)
        for idxs in self.session_turns.values():
            idxs.sort(key=lambda i: self.turns[i].turn)
        self.holder: dict[str, _Replica] = {}
        self.context: dict[str, int] = {}
        self.records = [RequestRecord(request_id=t.request_id, rid=i, session_id=t.session_id, turn=t.turn,
                                      new_tokens=t.new_tokens, output_tokens=t.output_tokens)
                        for i, t in enumerate(self.turns)]

    # ------------------------------------------------------------------ routing
    def _route(self, sid: str, turn: int) -> _Replica:
        if self.router == "round-robin":
            r = self.replicas[self._rr % len(self.replicas)]
            self._rr += 1
            return r
        if self.router == "session-affinity" and sid in self.holder:
            return self.holder[sid]
        return min(self.replicas, key=lambda r: (r.outstanding, r.idx))

    # ------------------------------------------------------------------ intake
    def _submit(self, idx: int, ready_s: float) -> None:
        t = self.turns[idx]
        rec = self.records[idx]
        rec.arrival_s = ready_s
        sid = t.session_id
        rep = self._route(sid, t.turn)
        old = self.holder.get(sid)
        new_tokens = t.new_tokens
        if old is not None and old is not rep:  # migrate: drop the KV there, recompute the history here
            self._touch(old)
            old.sched.end_session(sid)
            new_tokens += self.context.get(sid, 0)
        self.holder[sid] = rep
        rec.replica = rep.idx
        rec.prefill_tokens = new_tokens
        if not (rep.in_run and rep.sched.run_admits_nothing()):  # else the run's steps are the same with it queued
            self._touch(rep)
        events = rep.sched.add_request(idx, sid, new_tokens, t.output_tokens, prefix=t.prefix)
        if events:  # rejected at intake
            self._reject_session(idx, events[0].detail, rep)
            return
        if self.monitor is not None:
            self.monitor.arrived(idx, ready_s)
        rep.outstanding += new_tokens + t.output_tokens
        if rep.wake is not None and not rep.wake.triggered:
            rep.wake.succeed()

    @staticmethod
    def _touch(rep: _Replica) -> None:
        """Something outside changes the replica's scheduler now: a fast-forwarded run stops after this step."""
        if rep.in_run:
            rep.in_run = False
            rep.proc.interrupt()

    def _reject_session(self, idx: int, reason: str, rep: _Replica) -> None:
        t = self.turns[idx]
        self._touch(rep)  # its session's resident KV goes: a run in progress stops after this step
        self._mark_rejected(idx, reason)
        for j in self.session_turns[t.session_id]:
            if self.turns[j].turn > t.turn:
                self._mark_rejected(j, "previous turn rejected")
        rep.sched.end_session(t.session_id)
        self.holder.pop(t.session_id, None)

    def _mark_rejected(self, idx: int, reason: str) -> None:
        rec = self.records[idx]
        rec.status, rec.reason = "rejected", reason
        if self.monitor is not None:
            self.monitor.rejected(idx)
        if self.progress:
            self.progress(1)

    def _arrivals(self):
        firsts = sorted((i for i, t in enumerate(self.turns) if t.turn == 0),
                        key=lambda i: (self.turns[i].arrival_s, i))
        env = self.env
        for i in firsts:
            dt = self.turns[i].arrival_s - env.now
            if dt > 0:
                yield env.timeout(dt)
            self._submit(i, float(self.turns[i].arrival_s))

    # ------------------------------------------------------------------ replicas
    def _run_replica(self, rep: _Replica):
        env, sched = self.env, rep.sched
        ff = self.fast_forward and rep.ff
        while True:
            if not sched.has_work():
                rep.wake = env.event()
                yield rep.wake
                rep.wake = None
                continue
            if ff:
                run = sched.plan_run(min_steps=MIN_RUN_STEPS)
                if run is not None:
                    yield from self._fast_forward(rep, run)
                    if self.monitor is not None and self.monitor.check(env.now):
                        yield self._halt()
                    continue
            t0 = env.now
            plan = sched.schedule()
            if plan.empty:  # nothing runnable until something else happens (an arrival)
                self._handle(rep, sched.update(plan, StepResult(plan.step, 0.0)), t0, t0)
                rep.wake = env.event()
                yield rep.wake
                rep.wake = None
                continue
            if rep.ahead:
                yield from self._steps_ahead(rep, plan)
                continue
            res = rep.executor.execute(plan)
            yield env.timeout(res.duration_s)
            events = sched.update(plan, res)
            self._account(rep, plan, res, events, t0)
            if self.monitor is not None and self.monitor.check(env.now):
                yield self._halt()

    def _account(self, rep: _Replica, plan, res: StepResult, events, t0: float, kv: tuple | None = None) -> None:
        """A step ended now (``env.now``): its time, KV sample (``kv``: pages and live tokens taken right after its
        scheduler update, default now) and events."""
        tr, sched = rep.trace, rep.sched
        t1 = self.env.now
        tr.steps += 1
        tr.busy_s += res.duration_s
        if plan.num_prefill:
            tr.prefill_step_s += res.duration_s
        bd = tr.breakdown
        for k, v in res.breakdown.items():
            bd[k] = bd.get(k, 0.0) + v
        if self.record_kv:
            tr.t.append(t1)
            n_used, live = kv if kv is not None else (sched.pool.n_used, sched.live_tokens)
            tr.reserved.append(n_used)
            tr.live.append(live)
        self._handle(rep, events, t0, t1)

    def _steps_ahead(self, rep: _Replica, plan):
        """Steps of an executor that runs ahead (``launch`` / ``complete``): while a step is in flight the scheduler
        advances past it (it never reads token values) and the next step is planned and launched, so its host work
        overlaps the device; then the first step completes and the clock advances by its measured duration. The
        look-ahead stops where the synchronous order could differ: at a step that finishes a turn (its events may
        submit the session's next turn before the next plan), when nothing is left to run, or when the executor ran
        the step synchronously. A turn that arrives while a step runs joins one step later than in the synchronous
        loop (as in vLLM's asynchronous scheduling)."""
        env, sched, ex = self.env, rep.sched, rep.executor
        t0 = env.now
        flying = ex.launch(plan)
        while True:
            if not flying:  # ran synchronously: the usual order
                res = ex.complete()
                yield env.timeout(res.duration_s)
                self._account(rep, plan, res, sched.update(plan, res), t0)
                break
            events = sched.update(plan, StepResult(plan.step, 0.0))  # provisional: nothing of the result is read
            kv = (sched.pool.n_used, sched.live_tokens) if self.record_kv else None
            nxt, extra = None, []
            if not any(ev.kind == "finished" for ev in events) and sched.has_work():
                nxt = sched.schedule()
                if nxt.empty:
                    extra, nxt = sched.update(nxt, StepResult(nxt.step, 0.0)), None
                else:
                    nxt_flying = ex.launch(nxt)
            res = ex.complete()
            yield env.timeout(res.duration_s)
            self._account(rep, plan, res, events, t0, kv)
            if extra:  # an empty plan's events (nothing was runnable after this step)
                self._handle(rep, extra, env.now, env.now)
            if self.monitor is not None and self.monitor.check(env.now):
                if nxt is not None:
                    ex.complete()  # the launched step ends before the replay does
                yield self._halt()
            if nxt is None:
                break
            plan, flying, t0 = nxt, nxt_flying, env.now

    def _halt(self) -> simpy.Event:
        """The SLO is certain to be missed: end the replay now (the replica waits on the stop event)."""
        if not self._stop.triggered:
            self._stop.succeed(self.monitor.reason)
        return self._stop

    def _fast_forward(self, rep: _Replica, run):
        """Advance through ``run`` in one event; an outside change to the replica cuts it at the step in progress."""
        env, tr = self.env, rep.trace
        t0 = env.now
        res = rep.executor.execute_run(run)
        d = res.durations
        ends = np.cumsum(np.concatenate(([t0], d)))[1:]  # the step-by-step clock: t0 + d1, then + d2, ...
        j = run.k
        rep.in_run = True
        try:
            yield env.timeout(ends[-1] - t0)
        except simpy.Interrupt:  # something arrived during step j: it ends, then the next step sees it
            j = min(run.k, int(np.searchsorted(ends, env.now, side="left")) + 1)
            yield env.timeout(max(0.0, ends[j - 1] - env.now))
        rep.in_run = False
        sched = rep.sched
        events = sched.commit_run(run, j)
        rep.executor.commit_run(res, j)
        t1 = env.now
        tr.steps += j
        tr.runs += 1
        tr.run_steps += j
        tr.busy_s += float(d[:j].sum())
        tr.prefill_step_s += float(d[:j][run.num_prefill[:j] > 0].sum())
        bd = tr.breakdown
        for k, v in res.breakdown.items():
            bd[k] = bd.get(k, 0.0) + float(v[:j].sum())
        if self.record_kv:
            tr.t.extend(ends[: j - 1].tolist())
            tr.t.append(t1)
            tr.reserved.extend(run.reserved()[: j - 1].tolist())
            tr.reserved.append(sched.pool.n_used)
            tr.live.extend(run.live()[: j - 1].tolist())
            tr.live.append(sched.live_tokens)
        self._handle(rep, events, float(ends[j - 2]) if j > 1 else t0, t1)

    def _handle(self, rep: _Replica, events, t0: float, t1: float) -> None:
        for ev in events:
            rec = self.records[ev.rid]
            k = ev.kind
            if k == "first_token":
                rec.first_token_s = t1
                if self.monitor is not None:
                    self.monitor.first_token(ev.rid, t1)
            elif k == "finished":
                rec.finish_s = t1
                rec.status = "finished"
                rec.cached_tokens = rep.sched.requests[ev.rid].cached_tokens
                if self.monitor is not None:
                    self.monitor.finished(ev.rid, t1, rec.first_token_s)
                self._finished(rep, ev.rid, t1)
            elif k == "admitted":
                if rec.admitted_s is None:
                    rec.admitted_s = t0
            elif k == "preempted":
                rec.preemptions += 1

    def _finished(self, rep: _Replica, idx: int, t1: float) -> None:
        t = self.turns[idx]
        rep.outstanding -= self.records[idx].prefill_tokens + t.output_tokens
        sid = t.session_id
        self.context[sid] = self.context.get(sid, 0) + t.new_tokens + t.output_tokens
        if self.progress:
            self.progress(1)
        turns = self.session_turns[sid]
        pos = turns.index(idx)
        if pos + 1 == len(turns):
            rep.sched.end_session(sid)
            self.holder.pop(sid, None)
            return
        nxt = turns[pos + 1]
        think = self.turns[nxt].think_time_s
        if think <= 0:
            self._submit(nxt, t1)
        else:
            ev = self.env.timeout(think)
            ev.callbacks.append(lambda _e, n=nxt, r=t1 + think: self._submit(n, r))

    # ------------------------------------------------------------------ run
    def run(self, until: float | None = None) -> ClusterResult:
        self.env.process(self._arrivals())
        for rep in self.replicas:
            rep.proc = self.env.process(self._run_replica(rep))
        self.env.run(until=until)
        stopped = self._stop.value if self._stop.triggered else None
        for rec in self.records:  # nothing silently dropped: anything unfinished is listed with why
            if rec.status not in ("finished", "rejected"):
                why = f"stopped early: {stopped}" if stopped else "simulation horizon reached" if until is not None \
                    else "stalled: the scheduler could not make progress (no runnable work and no further arrivals)"
                rec.status, rec.reason = "rejected", why
        return ClusterResult(self.records, [r.trace for r in self.replicas], [r.sched for r in self.replicas],
                             float(self.env.now), stopped)
