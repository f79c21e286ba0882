"""The simulated executor: prices a :class:`~tangram.plan.StepPlan` and returns its duration.

Everything else (scheduler, paging, planner) is the shared control plane; this
module only answers "how long does this step take on the GPU and the host".
Each operator is priced from a cost table (sim/tables/<gpu>/) when there is one, otherwise
from the GPU preset's roofline; :attr:`CostModel.sources` says which, per
operator. Formulas are documented in docs/simulator.md. All per-step work is
numpy over the step's rows and heads (no Python loop over requests or heads).
"""
from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tangram.budgets import BudgetProfile, drawn_keep
from tangram.config import EngineConfig, GPUConfig, ModelConfig
from tangram.errors import ConfigError
from tangram.paging import KVLayout
from tangram.plan import RunResult, StepPlan, StepResult, StepRun
from tangram.planner import (DecodeCosts, aot_bucket_split_map, decode_context_bucket, flashdecoding_num_splits,
                             launch_fixed_times, launch_layer_times, launch_wave_time, pow2_bucket, runtime_plan,
                             split_kv_block, tail_layer_times, tail_wave_time, wave_launch)

from . import engine_overhead
from .tables import resolve as resolve_tables

HOST_COEFFS_PATH = Path(__file__).resolve().parent / "tables" / "host_coeffs.json"

GEMM_OPS = ("qkv", "o", "gate_up", "down")
HOST_TERMS = ("host", "runtime_plan", "reclaim")  # control-plane work on the host, outside the executor's kernels


def _context_buckets(contexts: np.ndarray) -> list[int]:
    """``decode_context_bucket`` of each context: one bucket for all when the smallest and the largest share it (the
    bucket never falls as the context grows; a run's contexts are consecutive and mostly within one bucket)."""
    lo, hi = decode_context_bucket(int(contexts.min())), decode_context_bucket(int(contexts.max()))
    if lo == hi:
        return [lo] * int(contexts.size)
    return [decode_context_bucket(c) for c in contexts.tolist()]


def kernel_terms(breakdown: dict) -> dict[str, float]:
    """A step's kernel seconds by :data:`engine_overhead.TERMS` ("dense": its GEMMs and element-wise ops)."""
    out = {}
    for t, (keys, _) in engine_overhead.TERM_KEYS.items():
        v = 0  # as sum(): 0 + each term in order (the same floats or arrays bit for bit, without a generator a term)
        for k in keys:
            v = v + breakdown.get(k, 0.0)
        out[t] = v
    return out


@dataclass(frozen=True)
class CostParams:
    """Constants of the analytic fallback; each is a stated assumption, not a fit to a paper figure."""

    roofline_bw_eff: float = 0.80  # share of datasheet HBM bandwidth a streaming kernel reaches
    roofline_gemm_eff: float = 0.70  # share of dense bf16 peak a large GEMM reaches
    roofline_attn_eff: float = 0.45  # share of peak a FlashAttention-2-class prefill kernel reaches
    kernel_launch_s: float = 2e-6  # per kernel launch (CUDA graphs amortise most of it)
    # A lone CTA streams at most (bytes it keeps in flight) / (memory latency), Little's law: one K and
    # one V tile of 64 tokens x 128 dims in bf16 (32 KiB) per ~1 us loaded HBM round trip.
    cta_peak_bytes_per_s: float = 32768 / 1.0e-6
    score_window: int = 64  # SnapKV observation window (queries scoring each new token)
    aot_batch_buckets: bool = True  # split maps per power-of-two batch bucket (N_CTA / bucket), a lookup
    decode_refresh: float = 0.01  # re-run the wave model when the same batch's tokens grew by more than this
    # "auto": decode priced by the folder's fitted decode_costs.json (the AOT routing's model) when it has one, else
    # by the capped wave model; "capped": the capped wave model always (the pricing before decode_costs.json priced
    # decode, for A/B comparisons: benchmarks/decode_pricing.py)
    decode_model: str = "auto"
    # Price the eager engine's per-step issue/sync overhead (sim/engine_overhead.py) when the tables folder
    # has a fitted engine_overhead.json for the model; False prices kernels back to back (a CUDA-graph engine).
    engine_overhead: bool = True
    # tensor parallelism's ring model (sim/tp.py) when the tables folder has no allreduce.csv for the degree:
    # NCCL's ring all-reduce reaches ~80% of the NVLink per-direction bandwidth as bus bandwidth at large sizes,
    # and ~10 us for a small message between two GPUs of one host (assumptions, not fits: run
    # ``python -m tangram.sim.fit_allreduce`` on the machine to replace them)
    allreduce_bw_eff: float = 0.80
    allreduce_latency_s: float = 10e-6


@dataclass(frozen=True)
class HostCoeffs:
    """Seconds per unit of host control-plane work, measured on this CPU by ``python -m tangram.sim.fit_host``."""

    step_s: float = 2.0e-5
    decode_row_s: float = 1.0e-6
    prefill_row_s: float = 2.0e-5
    decode_row_table_s: float = 0.0  # per decode row and per page table (grows as H_p shrinks)
    prefill_row_table_s: float = 0.0
    row_touched_s: float = 2.0e-7
    page_s: float = 5.0e-8
    admit_s: float = 3.0e-5
    evict_s: float = 1.0e-5
    preempt_s: float = 3.0e-5
    reclaim_page_s: float = 1.0e-7
    compress_row_s: float = 2.0e-5
    runtime_plan_item_s: float = 2.0e-9
    source: str = "default (not measured)"

    @classmethod
    def load(cls, path: str | Path = HOST_COEFFS_PATH) -> "HostCoeffs":
        p = Path(path)
        if not p.exists():
            return cls()
        d = json.loads(p.read_text())
        names = {f for f in cls.__dataclass_fields__}
        vals = {k: v for k, v in d.get("coefficients", {}).items() if k in names}
        return cls(**vals, source=f"measured: {d.get('command', p.name)} ({d.get('cpu', 'this CPU')})")


_CTA_FIT_CACHE: dict = {}


def _fit_cta_rate(cm: "CostModel") -> tuple[float, int] | None:
    """A lone CTA's streaming rate, fitted to the measured static-split rows on skewed lengths.

    Each row is re-priced by this model's own static partition on the lengths the kernels bench
    used (``ceil(B * context)`` of ``synthetic_profile(L, H, rho, seed)``), for a geometric grid
    of rates; the rate with the least squared log error wins. Cached per process.
    """
    from tangram.budgets import synthetic_profile

    t = cm.tables
    rows = t._model_rows(t.decode, cm.model)
    if rows is None or "profile_seed" not in rows.columns or "rho" not in rows.columns:
        return None
    rows = rows[(rows["kernel"] == "static_split") & (rows["rho"] < 1)]
    rows = rows[rows["profile_seed"].notna() & (rows["profile_seed"].astype(str) != "")]
    if len(rows) == 0:
        return None
    key = (t.fingerprint, cm.model.name, cm.gpu.name, cm.n_occ, round(cm.dec_bw), round(cm.dec_launch * 1e9))
    if key in _CTA_FIT_CACHE:
        return _CTA_FIT_CACHE[key]
    rows = rows.sort_values(["batch", "context", "rho"]).iloc[:: max(1, len(rows) // 24)]
    m = cm.model
    eng = cm.engine.with_(mode="full", decode_partition="static")
    probe = CostModel.__new__(CostModel)
    probe.__dict__.update(cm.__dict__)
    probe.partition, probe._static_splits = "static", {}
    cases = []
    for _, r in rows.iterrows():
        B = synthetic_profile(m.num_layers, m.num_kv_heads, float(r["rho"]), seed=int(float(r["profile_seed"]))).B
        lens = np.minimum(int(r["context"]), np.ceil(B * int(r["context"]) - 1e-9)).astype(np.int64)
        cases.append((np.repeat(lens[None], int(r["batch"]), axis=0), float(r["median_ms"]) * 1e-3))
    grid = np.geomspace(cm.dec_bw / cm.n_occ, cm.dec_bw, 24)
    best, best_err = None, np.inf
    for g in grid:
        probe.cta_bw = g
        err = sum(np.log(probe._decode_attention(lens)[0] / m.num_layers / meas) ** 2 for lens, meas in cases)
        if err < best_err:
            best, best_err = float(g), err
    del eng
    _CTA_FIT_CACHE[key] = (best, len(cases))
    return _CTA_FIT_CACHE[key]


LAUNCH_CACHE_BYTES = 192 << 20  # CostModel._launch's kept launch shapes, by their arrays' bytes


def _launch_bytes(hit: tuple) -> int:
    """Bytes of the arrays of one kept launch (``CostModel._launch``'s tuple, its WaveLaunch first)."""
    arrays = [v for v in vars(hit[0]).values() if isinstance(v, np.ndarray)]
    arrays += [v for v in hit[1:] if isinstance(v, np.ndarray)]
    return sum(a.nbytes for a in {id(a): a for a in arrays}.values())


def _groups(keys: list) -> dict:
    """Positions of each distinct key, in first-seen order: a list of them, or ``0`` when every key is the same
    (the usual case, and one pricing of one point: no fancy indexing)."""
    k0 = keys[0]
    if len(keys) == 1 or all(k == k0 for k in keys):
        return {k0: 0}
    out: dict = {}
    for i, k in enumerate(keys):
        out.setdefault(k, []).append(i)
    return out


class CostModel:
    """``execute(plan) -> StepResult`` for one engine replica; deterministic given ``seed``."""

    def __init__(self, model: ModelConfig, gpu: GPUConfig, engine: EngineConfig, layout: KVLayout,
                 profile: BudgetProfile | None = None, *, tables: str | Path | None = "auto",
                 params: CostParams | None = None, host: HostCoeffs | None = None, seed: int = 0):
        self.model, self.gpu, self.engine, self.layout = model, gpu, engine, layout
        self.profile = profile.with_alpha(engine.alpha) if profile is not None else None
        self.params = params or CostParams()
        self.host = host or HostCoeffs.load()
        # "auto", a folder, None or a CostTables; measured on another GPU model -> transferred by datasheet
        self.tables = resolve_tables(tables, gpu)
        self.seed = seed
        self.partition = engine.partition
        if engine.retention == "global" and self.profile is None:
            raise ConfigError("dynamic mode needs a budget profile to draw realised retention")
        L, H = model.num_layers, model.num_kv_heads
        self.gq = model.gqa_group
        self.tok_head_bytes = 2 * model.head_dim * model.dtype_bytes
        self.sources: dict[str, str] = {}
        self._launches: dict[tuple, tuple] = {}  # _launch, the last few
        self._launch_bytes = 0  # their arrays' bytes

        # -- decode attention: launch + bytes / BW per call, from the table fit or the roofline
        # n_occ: decode CTAs resident at once (the wave size); n_cta: the CTAs a plan aims for, n_cta_scale
        # waves of them (the engine's AOT table and runtime plan take the same product)
        self.n_occ, n_cta_src = self.tables.n_cta(gpu.num_sms)
        self.n_cta = max(1, int(round(self.n_occ * engine.n_cta_scale)))
        fit = self.tables.decode_fit(model)
        if fit is not None:
            self.dec_launch, self.dec_bw, src = fit
        else:
            copy = self.tables.copy_bandwidth()
            self.dec_launch = self.params.kernel_launch_s
            if copy is not None:
                self.dec_bw, src = copy, "roofline: measured copy bandwidth (meta.json)"
            else:
                self.dec_bw = gpu.mem_bandwidth * self.params.roofline_bw_eff
                src = f"roofline: {self.params.roofline_bw_eff:g} x datasheet HBM bandwidth"
        self.cta_bw = max(self.params.cta_peak_bytes_per_s, self.dec_bw / self.n_occ)
        # the AOT regime choice's launch costs: the same file the engine's split table reads (one choice), carried
        # by the tables' transfer and probe rescale (CostTables.decode_costs; DecodeCosts.for_gpu on the engine)
        self.decode_costs = self.tables.decode_costs(model.name)
        # ... and, when fitted, the decode price of every partition: one model of the kernel for choosing a launch
        # and for pricing it (tangram.planner.launch_layer_times); without a fit, the fallback below
        if self.params.decode_model not in ("auto", "capped"):
            raise ConfigError(f"CostParams.decode_model must be 'auto' or 'capped', got {self.params.decode_model!r}")
        self.price_costs = self.decode_costs if self.tables.has_decode_costs and self.params.decode_model == "auto" \
            else None
        where = (f"{self.n_occ} resident CTAs ({n_cta_src}), plans aim at {self.n_cta} (n_cta_scale "
                 f"{engine.n_cta_scale:g}); partition={self.partition}")
        if self.price_costs is not None:
            c = self.price_costs
            self.sources["decode_attention"] = (
                f"table:{c.source} ({c.rate_model} rate model, tangram.planner.launch_layer_times: the AOT "
                f"routing's model); {where}")
        else:
            cta_src = f"CTA rate {self.cta_bw / 1e9:.3g} GB/s assumed"
            if fit is not None:
                cfit = _fit_cta_rate(self)
                if cfit is not None:
                    self.cta_bw, nrows = cfit
                    cta_src = f"CTA rate {self.cta_bw / 1e9:.3g} GB/s fitted on {nrows} static_split rows"
            why = "decode_model='capped'" if self.params.decode_model == "capped" else \
                f"fallback: no {DecodeCosts.FILENAME} in the tables folder"
            self.sources["decode_attention"] = f"{src}; {cta_src} (capped rate model; {why}); {where}"
        self._split_maps: dict[tuple[int, int], np.ndarray] = {}
        self._reps: dict[tuple[int, int, int], np.ndarray] = {}  # _aot_reps, the last few
        if self.partition == "aot":
            self.sources["decode_split_choice"] = self.decode_costs.source if self.decode_costs is not None else \
                "default: Algorithm 1 capped per context bucket (no tables folder)"
        self._dec_cache = None
        self._dec_fixed = 0.0  # the part of the last _decode_attention that does not grow with the bytes
        self._static_splits: dict[tuple[int, int], int] = {}
        if self.partition == "aot":
            if self.profile is not None:
                self._B_slots = layout.to_slots(self.profile.B)
            else:  # full/uniform with an AOT partition: every head alike
                self._B_slots = np.ones((L, H))

        # -- GEMMs and element-wise ops per token count, memoised
        h, d, Hq = model.hidden, model.head_dim, model.num_q_heads
        self.gemm_shapes = {"qkv": ((Hq + 2 * H) * d, h), "o": (h, Hq * d), "gate_up": (2 * model.intermediate, h),
                            "down": (h, model.intermediate), "lm_head": (model.vocab, h)}
        self._gemm_interp = {}
        for op, (n, k) in self.gemm_shapes.items():
            f = self.tables.gemm_interp(model, op, n, k)
            self._gemm_interp[op] = f
            self.sources[f"gemm_{op}"] = "table:gemm.csv" if f is not None else \
                f"roofline: max(FLOPs / ({self.params.roofline_gemm_eff:g} x peak), bytes / BW)"
        self._elem = {}
        for op in ("rmsnorm", "rope", "silu_mul", "sampling"):
            f = self.tables.elementwise_interp(model, op)
            self._elem[op] = f
            self.sources[f"elementwise_{op}"] = "table:elementwise.csv" if f is not None else "roofline: bytes / BW"
        self.sources["sampling"] = self.sources.pop("elementwise_sampling")
        self._dense_cache: dict[tuple[int, int], tuple[float, float]] = {}
        self.shards = 1  # ranks one replica's dense layers are split over (TPCostModel: the TP degree)
        self._row_tables: dict[tuple[str, str], np.ndarray] = {}

        # -- prefill attention + compression scoring/selection/scatter
        self._prefill = self.tables.prefill_interp(model)
        pf_src = "table:prefill_attention.csv (per layer, scipy interpolation)" if self._prefill is not None else \
            f"roofline: max(FLOPs / ({self.params.roofline_attn_eff:g} x peak), bytes / BW)"
        self.sources["prefill_attention"] = pf_src
        self.compress = engine.retention != "full"
        if self.compress:
            has = self._prefill is not None and "score_ms" in self._prefill.cols
            self.sources["compression"] = "table:prefill_attention.csv score/select/scatter" if has else \
                "roofline: window scoring FLOPs + top-k/scatter bytes"
        self.sources["host_control_plane"] = self.host.source
        self.overhead = engine_overhead.load(self.tables.directory, model.name) if self.params.engine_overhead \
            else None
        self.sources["engine_overhead"] = self.overhead.source if self.overhead is not None else \
            "none: kernels back to back (no fitted engine_overhead.json, or engine_overhead off)"
        if engine.retention == "global":
            self.sources["reclaim"] = f"host: pages x reclaim_page_s + rows x compress_row_s ({self.host.source})"
        if self.partition == "runtime":
            self.sources["runtime_plan"] = f"host: runtime_plan host_items x runtime_plan_item_s ({self.host.source})"
        if self.tables.provenance:  # tables measured elsewhere: every table-priced operator says so
            lab = self.tables.label
            self.sources = {k: f"{v} [{lab}]" if v.startswith("table:") else v for k, v in self.sources.items()}
            self.sources["cost_tables"] = lab
            moved = [p for p in self.tables.provenance if p.get("kind") == "transfer"]
            if self.overhead is not None and moved:
                self.sources["engine_overhead"] += (f"; carried over unchanged from the {moved[0]['from']} fit (its "
                                                    f"kernel scales and issue/sync seconds assumed to hold on "
                                                    f"{moved[-1]['to']})")

    # ------------------------------------------------------------------ executor
    def execute(self, plan: StepPlan) -> StepResult:
        br: dict[str, float] = {}
        kd, kp = plan.num_decode, plan.num_prefill
        logits = kd + int(plan.prefill_last.sum()) if kp else kd
        tokens = plan.num_tokens
        if tokens:
            br["gemm"], br["elementwise"] = self._dense(tokens, logits)
        if kd:
            br["decode_attention"], plan_s = self._decode_cached(plan)
            if plan_s:
                br["runtime_plan"] = plan_s
        realized = None
        if plan.copy_src.size:  # shared prefixes: copy-on-write of partial pages before the forward
            br["page_copy"] = self._page_copy(int(plan.copy_src.size))
        if kp:
            br["prefill_attention"], comp = self._prefill_attention(plan)
            if self.compress:
                br["compression"] = comp
            if plan.retention == "global":
                realized, br["reclaim"] = self._dynamic(plan)
        if self.overhead is not None:
            terms = kernel_terms(br)
            br["engine_overhead"] = float(self.overhead.step_s(terms, self.model.num_layers, kd, kp, self.compress,
                                                               self.partition == "aot",
                                                               self.engine.decode_graphed(kd, kp),
                                                               self.layout.n_tables, tokens - kd)) \
                - sum(terms.values())
        br["host"] = self._host(plan.counters)
        return StepResult(plan.step, float(sum(br.values())), br, realized)

    # ------------------------------------------------------------------ runs of decode steps (fast-forward)
    def execute_run(self, run: StepRun) -> RunResult:
        """Price the ``k`` steps of ``run`` at once: each step's duration and terms equal what :meth:`execute` gives
        for ``run.plan(j)`` after steps 1..j-1 (the same functions, on arrays over the steps; decode attention with
        the same rescale cache). Changes nothing; :meth:`commit_run` does."""
        k, kd = run.k, run.num_decode
        kp = run.num_prefill
        br: dict[str, np.ndarray] = {}
        if kp.any():
            tokens = kd + np.bincount(run.chunk_step, weights=run.chunk_tokens, minlength=k + 1)[1:].astype(np.int64)
            logits = kd + np.bincount(run.chunk_step, weights=run.chunk_last, minlength=k + 1)[1:].astype(np.int64)
            pairs = {}
            for t, lg in zip(tokens.tolist(), logits.tolist()):
                if (t, lg) not in pairs:
                    pairs[(t, lg)] = self._dense(t, lg)
            ge = np.array([pairs[(t, lg)] for t, lg in zip(tokens.tolist(), logits.tolist())])
            br["gemm"], br["elementwise"] = ge[:, 0].copy(), ge[:, 1].copy()
        else:
            g, e = self._dense(kd, kd)
            br["gemm"], br["elementwise"] = np.full(k, g), np.full(k, e)
        caches = []
        if kd:
            dec, plan_s, caches = self._decode_run(run)
            br["decode_attention"] = dec
            if plan_s is not None and plan_s.any():
                br["runtime_plan"] = plan_s
        if kp.any():
            att, comp = np.zeros(k), np.zeros(k)
            rows = self._prefill_rows(run.chunk_tokens, run.chunk_before, run.chunk_keep, run.retention)
            steps = np.flatnonzero(kp)
            if "att" in rows and ("comp" in rows or not self.compress):
                # every step's sums at once, as _prefill_sum adds them: np.add.reduceat adds one or two chunks as
                # ndarray.sum does, three or more in another order (last bits differ): those steps go one by one
                L = self.model.num_layers
                first = run._bounds[steps]
                att[steps] = np.add.reduceat(rows["att"], first) * L
                if "comp" in rows:
                    tot = 0
                    for x in rows["comp"]:
                        tot = tot + np.add.reduceat(x, first)
                    comp[steps] = tot * L
                steps = steps[kp[steps] > 2]
            for j in steps + 1:  # each step's chunks summed as the per-step path sums them
                att[j - 1], comp[j - 1] = self._prefill_sum(rows, run.chunks_of(int(j)))
            br["prefill_attention"] = att
            if self.compress:
                br["compression"] = comp
        if self.overhead is not None:
            terms = kernel_terms(br)
            br["engine_overhead"] = np.asarray(
                self.overhead.step_s(terms, self.model.num_layers, kd, kp, self.compress, self.partition == "aot",
                                     self.engine.decode_graphed(kd, kp), self.layout.n_tables,
                                     tokens - kd if kp.any() else 0),
                dtype=np.float64) - sum(terms.values())
        br["host"] = np.broadcast_to(np.asarray(self._host(run.counters()), dtype=np.float64), (k,))
        return RunResult(sum(br.values()), br, caches)

    def commit_run(self, result: RunResult, j: int) -> None:
        """Leave the decode-attention cache as ``j`` single steps would have."""
        for step, cache in reversed(result.state):
            if step <= j:
                self._dec_cache = cache
                return

    def _decode_run(self, run: StepRun) -> tuple[np.ndarray, np.ndarray | None, list]:
        """Decode attention of each step of a run: :meth:`_decode_cached`'s rule (rescale while the batch's tokens
        grew by at most ``decode_refresh`` since the last full pricing, else price it again) over the steps."""
        k = run.k
        totals = run.totals
        out = np.empty(k)
        if self.partition == "runtime":  # replanned every step on the host: no cache, one pricing per step
            plan_s = np.empty(k)
            for i in range(k):
                out[i], plan_s[i] = self._decode_attention(run.head_lens0 + (i + 1))
            return out, plan_s, []
        c, caches, i = self._dec_cache, [], 0
        ids = run.decode_ids
        ctx = int(run.ctx0.max()) + np.arange(1, k + 1)  # the batch's longest context at each step
        b0, b1 = decode_context_bucket(int(ctx[0])), decode_context_bucket(int(ctx[-1]))
        bucket = np.full(k, b0) if b0 == b1 else np.array([decode_context_bucket(int(x)) for x in ctx])
        up = 1.0 + self.params.decode_refresh
        tl = totals.tolist()

        def rescaled(i: int, base: int, b: int) -> int:
            """End of the steps from ``i`` a pricing of ``base`` tokens in bucket ``b`` rescales to: those whose
            tokens grew by at most ``decode_refresh`` and whose context bucket (split map) is still ``b``."""
            m = bisect_right(tl, base * up)
            if m <= i:
                return m
            if b0 == b1:
                return m if b == b0 else i
            return i + int(np.argmin(np.append(bucket[i:m] == b, False)))

        if c is not None and c[0].size == ids.size and np.array_equal(c[0], ids):
            m = rescaled(0, c[1], c[4])
            if m > 0:
                fixed = c[3]
                out[:m] = fixed + (c[2] - fixed) * totals[:m] / max(c[1], 1)
                i = m
        first = []  # steps priced in full; the steps after each up to the next are rescaled from it
        while i < k:  # where the rule prices in full depends on the token counts alone, not on the prices
            first.append(i)
            i = max(rescaled(i + 1, tl[i], int(bucket[i])), i + 1)
        if first:
            fa = np.array(first)
            t, fixed = self._decode_prices(run.head_lens0, fa + 1, ctx[fa])
            base = np.maximum(totals[fa], 1)
            seg = np.repeat(np.arange(fa.size), np.diff(np.append(fa, k)))  # the pricing each step comes from
            out[fa[0]:] = fixed[seg] + (t - fixed)[seg] * totals[fa[0]:] / base[seg]
            out[fa] = t  # the priced steps themselves (the rescale of a step from itself is not bit-exact)
            ids_c = ids.copy()
            caches = [(a + 1, (ids_c, int(totals[a]), ta, fb, int(bucket[a])))
                      for a, ta, fb in zip(first, t.tolist(), fixed.tolist())]
        return out, None, caches

    # ------------------------------------------------------------------ dense layers
    def _dense(self, tokens: int, logit_rows: int) -> tuple[float, float]:
        key = (tokens, logit_rows)
        hit = self._dense_cache.get(key)
        if hit is not None:
            return hit
        m, p, sh = self.model, self.params, self.shards
        bw = self.gpu.mem_bandwidth * p.roofline_bw_eff
        g = 0.0
        for op in GEMM_OPS + ("lm_head",):
            rows = tokens if op != "lm_head" else logit_rows
            if rows:
                g += (m.num_layers if op != "lm_head" else 1) * self._gemm_time(op, rows)
        e = 0.0
        # element-wise work per token; with tensor parallelism RoPE and SiLU*up run on the rank's shard only
        per_tok = {"rmsnorm": 2 * 2 * m.hidden, "rope": 2 * 2 * (m.num_q_heads + m.num_kv_heads) * m.head_dim / sh,
                   "silu_mul": 3 * m.intermediate / sh}
        for op, elems in per_tok.items():
            reps = m.num_layers * (2 if op == "rmsnorm" else 1)
            f = self._elem[op]
            share = 1.0 if op == "rmsnorm" else 1.0 / sh
            t = self._table_time(("elem", op), f, tokens) * share if f is not None else \
                tokens * elems * m.dtype_bytes / bw + p.kernel_launch_s
            e += reps * t
        if logit_rows:  # sampling over the vocabulary, once per step
            f = self._elem["sampling"]
            e += self._table_time(("elem", "sampling"), f, logit_rows) if f is not None else \
                logit_rows * m.vocab * 4 * 2 / bw + p.kernel_launch_s
        self._dense_cache[key] = (g, e)
        return g, e

    def _gemm_time(self, op: str, rows: int) -> float:
        """One call of GEMM ``op`` on ``rows`` tokens: the table, else the roofline of its shape."""
        f = self._gemm_interp[op]
        if f is not None:
            return self._table_time(("gemm", op), f, rows)
        return self._gemm_roofline(*self.gemm_shapes[op], rows)

    def _gemm_roofline(self, n: int, k: int, rows: int) -> float:
        m, p = self.model, self.params
        peak, bw = self.gpu.bf16_flops * p.roofline_gemm_eff, self.gpu.mem_bandwidth * p.roofline_bw_eff
        return max(2.0 * rows * n * k / peak, (n * k + rows * k + rows * n) * m.dtype_bytes / bw) + p.kernel_launch_s

    def _table_time(self, key, f, rows: int) -> float:
        """``f(rows)`` of a table interpolant, read from its values at every size 0..n-1 computed in one call
        (grown by doubling): prefill steps bring new token counts all the time, and one scipy call per count
        and operator was a tenth of a simulation."""
        tab = self._row_tables.get(key)
        if tab is None or rows >= tab.size:
            tab = np.asarray(f(np.arange(max(1024, 2 * (rows + 1)), dtype=np.float64)), dtype=np.float64)
            self._row_tables[key] = tab
        return float(tab[rows])

    # ------------------------------------------------------------------ decode attention
    def split_map(self, batch: int, context: int | None = None) -> np.ndarray:
        """The engine's AOT split map S[L, G] for a batch whose longest logical context is ``context`` (one map
        per power-of-two batch bucket and context bucket: a table lookup at run time); every head of group g gets
        S[l, g] CTAs per request (:func:`tangram.planner.aot_bucket_split_map`, with the same decode costs)."""
        b = pow2_bucket(batch) if self.params.aot_batch_buckets else 1
        c = decode_context_bucket(context) if context is not None else decode_context_bucket(1 << 30)
        S = self._split_maps.get((b, c))
        if S is None:
            lay, m = self.layout, self.model
            # B is already in slot order, so the identity permutation groups consecutive slots.
            ident = np.tile(np.arange(lay.num_kv_heads), (lay.num_layers, 1))
            S = aot_bucket_split_map(self._B_slots, ident, lay.heads_per_group, self.n_occ, b,
                                     waves=self.engine.n_cta_scale, rounding=self.engine.split_rounding, context=c,
                                     costs=self.decode_costs, gq=m.gqa_group, head_dim=m.head_dim,
                                     dtype_bytes=m.dtype_bytes, num_sms=self.gpu.num_sms)
            self._split_maps[(b, c)] = S
        return S

    def _static_split(self, batch_heads: int, n_blocks: int) -> int:
        key = (batch_heads, n_blocks)
        s = self._static_splits.get(key)
        if s is None:
            s = flashdecoding_num_splits(batch_heads, self.gpu.num_sms, n_blocks)
            self._static_splits[key] = s
        return s

    def _decode_cached(self, plan: StepPlan) -> tuple[float, float]:
        """Decode attention of the same batch as the last priced step, grown by < ``decode_refresh``
        in retained tokens, is rescaled from it (the wave structure is unchanged; bytes grow linearly)."""
        lens = plan.decode_head_lens
        total = int(lens.sum())
        ctx = int(plan.decode_ctx.max())
        c = self._dec_cache
        if (c is not None and self.partition != "runtime" and c[0].size == plan.decode_ids.size
                and total <= c[1] * (1.0 + self.params.decode_refresh) and np.array_equal(c[0], plan.decode_ids)
                and c[4] == decode_context_bucket(ctx)):  # same context bucket: same split map
            fixed = c[3]
            return fixed + (c[2] - fixed) * total / max(c[1], 1), 0.0
        t, plan_s = self._decode_attention(lens, ctx)
        self._dec_cache = (plan.decode_ids.copy(), total, t, self._dec_fixed, decode_context_bucket(ctx))
        return t, plan_s

    def _decode_attention(self, lens: np.ndarray, context: int | None = None) -> tuple[float, float]:
        """Per layer: CTAs in launch order, dispatched in waves of the resident CTAs; a wave lasts as long as
        its bytes at full bandwidth or its heaviest CTA at one CTA's streaming rate, whichever is longer."""
        kd, L, H = lens.shape
        if self.partition == "runtime":  # FlashInfer-style per-layer plan recomputed every step on the host
            rp = runtime_plan(lens, self.n_cta)
            reps = np.stack(rp.splits).astype(np.int64).reshape(L, -1)  # [L, kd * H]
            launch, n_partials, self._dec_fixed, rows, at, cut = self._launch(None, reps, lens.shape)
            t = self._lens_totals(lens, np.zeros(1, dtype=np.int64), launch, n_partials, rows, at, cut, L)
            return float(t[0]), rp.host_items * self.host.runtime_plan_item_s
        t, fixed = self._decode_prices(lens, np.zeros(1, dtype=np.int64), None if context is None else
                                       np.array([context]))
        self._dec_fixed = float(fixed[0])
        return float(t[0]), 0.0

    def _decode_prices(self, lens0: np.ndarray, offs: np.ndarray, contexts: np.ndarray | None
                       ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_decode_attention` of the heads ``lens0`` [kd, L, H] grown by ``offs[i]`` tokens each (a running
        batch's decode steps), the batch's longest context ``contexts[i]``, for every i at once (aot and static
        partitions): seconds [m] and the fixed part of each pricing (the rescale cache's). Points of one launch
        shape are priced together, each exactly as alone."""
        kd, L, H = lens0.shape
        base, alike = lens0, 1
        # (key, the launch's CTA counts when the key is not kept): the counts are made only when needed, and checked
        # right before each launch is built, since building one may push an earlier key out of the kept ones
        if self.partition == "aot":
            keys = [None] if contexts is None else _context_buckets(contexts)
            launches = [(idx, ("aot", kd, b), lambda b=b, idx=idx: self._aot_reps(
                kd, None if b is None else int(contexts[idx if isinstance(idx, int) else idx[0]])))
                for b, idx in _groups(keys).items()]
        else:
            block_n = split_kv_block(self.model.head_dim)
            top = int(lens0.max()) if lens0.size else 0
            keys = [self._static_split(kd * H, max(1, -(-max(top + o, 1) // block_n))) for o in offs.tolist()]
            if L > 1 and (lens0 == lens0[:, :1, :1]).all():  # every layer alike: one priced for the L equal ones
                base, alike = lens0[:, :1], L
            l = base.shape[1]
            launches = [(idx, ("static", l, kd * H, sp), lambda sp=sp: np.full((l, kd * H), sp, dtype=np.int64))
                        for sp, idx in _groups(keys).items()]
        if len(launches) == 1:  # one launch shape for every point (the usual case)
            _, key, make = launches[0]
            launch, n_partials, f, rows, at, cut = self._launch(key, None if key in self._launches else make(),
                                                                base.shape)
            return self._lens_totals(base, offs, launch, n_partials, rows, at, cut, L), np.full(offs.size, alike * f)
        out, fixed = np.empty(offs.size), np.empty(offs.size)
        for idx, key, make in launches:
            launch, n_partials, f, rows, at, cut = self._launch(key, None if key in self._launches else make(),
                                                                base.shape)
            out[idx] = self._lens_totals(base, offs[idx], launch, n_partials, rows, at, cut, L)
            fixed[idx] = alike * f
        return out, fixed

    def _lens_totals(self, lens0: np.ndarray, offs: np.ndarray, launch, n_partials: int,
                     fixed: np.ndarray | None, at: np.ndarray, cut: np.ndarray, L: int) -> np.ndarray:
        """Seconds [m] of a decode launch laid out as ``launch`` (CTAs in the order layer, request, slot, split) on
        heads holding ``lens0 + offs[i]`` tokens, summed over ``L`` layers (``lens0`` [kd, l, H]: l = L, or one
        layer standing for L equal ones). Per layer: the fitted decode costs' seconds (:meth:`_layer_times`), else
        the fallback's wave time plus its merge partials and call intercept. A layer's bytes are its heads' tokens
        (the CTAs of a head split them), and only the last wave's CTAs are sized one by one (``at``: their heads'
        flat index into ``lens0``, ``cut``: the CTAs that head is split into; :meth:`_launch`), so a pricing costs
        the size of the last wave, not of the launch (:func:`tangram.planner.tail_wave_time`)."""
        kd, l, H = lens0.shape
        layer = lens0.sum(axis=0).sum(axis=1)  # [l] tokens (exact integers), grown by kd * H per offset
        total = (layer + offs[:, None] * (kd * H)) * float(self.tok_head_bytes)
        tail = lens0.reshape(-1)[at] + offs[:, None]  # (a view's reshape copies: alike layouts pass layer 0)
        tail = tail / cut
        tail *= self.tok_head_bytes
        c = self.price_costs
        if c is not None:
            per = tail_layer_times(total, tail, launch, c, gq=self.gq, head_dim=self.model.head_dim, fixed=fixed)
        else:
            per = tail_wave_time(total, tail, launch, self.dec_bw, self.cta_bw)
        t = per.sum(axis=1) if l == L else per[:, 0] * L  # one layer for L equal ones
        if c is not None:
            return t
        combine = (L // l) * n_partials * self.gq * (self.model.head_dim + 2) * 4 / self.dec_bw
        return t + combine + L * self.dec_launch  # the fitted intercept of a call includes its merge

    def _layer_times(self, size: np.ndarray, launch, fixed: np.ndarray | None = None) -> np.ndarray:
        """Seconds per layer of a decode launch of CTAs ``size`` [L, n] bytes laid out as ``launch``: the fitted
        decode costs through :func:`tangram.planner.launch_layer_times` (the model the AOT routing chooses maps
        by), else the fallback: the capped wave model at the balanced-call fit's bandwidth and the fitted lone-CTA
        rate, plus the partials' bytes and one fitted call intercept (which includes the merge kernel)."""
        c = self.price_costs
        if c is not None:
            return launch_layer_times(size, launch, c, gq=self.gq, head_dim=self.model.head_dim, fixed=fixed)
        t = launch_wave_time(size, launch, self.dec_bw, self.cta_bw)
        return t + launch.ctas * (self.gq * (self.model.head_dim + 2) * 4) / self.dec_bw + self.dec_launch

    def _fixed_rows(self, launch) -> tuple[float, np.ndarray | None]:
        """The seconds of a launch's rows that do not grow with its bytes (launches, per-wave latency, the merge
        and its partials): the rescale cache's fixed part (``_decode_cached``), and per row with fitted decode
        costs (what :func:`launch_layer_times` adds at every pricing of the launch). The fallback's: its
        intercepts."""
        if self.price_costs is None:
            return launch.reps.shape[0] * self.dec_launch, None
        rows = launch_fixed_times(launch, self.price_costs, gq=self.gq, head_dim=self.model.head_dim)
        rows.flags.writeable = False
        return float(rows.sum()), rows

    def _launch(self, key, reps: np.ndarray | None, shape: tuple) -> tuple:
        """The launch structure of ``reps`` (:func:`tangram.planner.wave_launch`), its CTA count, the fixed
        seconds of its rows (:meth:`_fixed_rows`) and where its last wave's CTAs read their heads' tokens in a
        ``lens`` array of ``shape`` [kd, L, H] (their flat index, and the CTAs their head is split into), kept for
        the last few launch shapes (``key``: what determines ``reps``, which may be None when ``key`` is kept;
        None: not kept). A running batch is priced again at every refresh with the same CTA counts: only sizes
        change."""
        hit = self._launches.get(key) if key is not None else None
        if hit is None:
            launch = wave_launch(reps, self.n_occ)
            kd, L, H = shape
            src = launch.tsrc  # flat index into [L, kd * H] (layer, request, slot) of each CTA or entry of the tail
            layer, rest = np.divmod(src, kd * H)
            row, slot = np.divmod(rest, H)
            at = (row * L + layer) * H + slot  # into [kd, L, H]
            cut = launch.reps.reshape(-1)[src]
            hit = (launch, int(reps.sum()), *self._fixed_rows(launch), at, cut)
            if key is not None:
                # a running batch's size goes up and down as turns join and leave: the last shapes are kept, up to
                # LAUNCH_CACHE_BYTES (a 12,000-request Mooncake replay meets 284 shapes of 0.35 MB on average; 64 kept
                # built 1,295 launches, 0.4 s of the replay)
                nb = _launch_bytes(hit)
                while self._launches and self._launch_bytes + nb > LAUNCH_CACHE_BYTES:
                    self._launch_bytes -= _launch_bytes(self._launches.pop(next(iter(self._launches))))
                self._launches[key] = hit
                self._launch_bytes += nb
        return hit

    def _aot_reps(self, batch: int, context: int | None) -> np.ndarray:
        """CTAs per (layer, request x slot) of the AOT split map, [L, batch * H] int64 (read-only; the last few
        kept: a batch is priced again and again while it runs)."""
        b = pow2_bucket(batch) if self.params.aot_batch_buckets else 1
        c = decode_context_bucket(context) if context is not None else decode_context_bucket(1 << 30)
        key = (batch, b, c)
        reps = self._reps.get(key)
        if reps is None:
            S = self.split_map(batch, context)
            per_head = np.repeat(S, self.layout.heads_per_group, axis=1).astype(np.int64)  # [L, H], slots
            L, H = per_head.shape
            reps = np.ascontiguousarray(np.broadcast_to(per_head[:, None, :], (L, batch, H))).reshape(L, -1)
            reps.flags.writeable = False
            if len(self._reps) >= 64:
                self._reps.pop(next(iter(self._reps)))
            self._reps[key] = reps
        return reps

    # ------------------------------------------------------------------ prefill
    def _prefill_attention(self, plan: StepPlan) -> tuple[float, float]:
        rows = self._prefill_rows(plan.prefill_tokens, plan.prefill_head_lens, plan.prefill_keep, plan.retention)
        return self._prefill_sum(rows, slice(None))

    def _prefill_rows(self, tokens, head_lens, keep, retention: str) -> dict:
        """Per-chunk terms of prefill attention and compression (summed per step by :meth:`_prefill_sum`); a run
        of steps evaluates the table interpolant once for all its chunks. ``head_lens`` may hold a subset of the
        KV heads (one tensor-parallel rank's, ``sim/tp.py``): the table, measured on all heads, is read at the
        subset's retained tokens scaled to all heads and its time taken in the subset's share."""
        m, p = self.model, self.params
        L, H, d = m.num_layers, head_lens.shape[-1], m.head_dim
        share = H / m.num_kv_heads
        c = tokens.astype(np.float64)
        cached = head_lens.reshape(c.size, -1).sum(axis=1).astype(np.float64)  # head-tokens, all layers
        out = {"c": c, "kept": keep.reshape(c.size, -1).sum(axis=1), "H": H}
        if self._prefill is not None:
            v = self._prefill(c, cached / (L * share))
            out["att"] = v["attention_ms"] * share
            if self.compress and "score_ms" in v:
                sel = "select_dynamic_ms" if retention == "global" and "select_dynamic_ms" in v else "select_ms"
                out["comp"] = [v[k] * share for k in ("score_ms", sel, "scatter_ms") if k in v]
        else:
            peak, bw = self.gpu.bf16_flops * p.roofline_attn_eff, self.gpu.mem_bandwidth * p.roofline_bw_eff
            flops = 4.0 * d * self.gq * c * (cached + L * H * c / 2)
            byts = cached * self.tok_head_bytes + 4.0 * L * H * c * self.tok_head_bytes  # cached KV + q/k/v/o
            out["roof"] = np.maximum(flops / peak, byts / bw)
        return out

    def _prefill_sum(self, rows: dict, sl: slice) -> tuple[float, float]:
        """Prefill attention and compression seconds of the chunks ``rows[sl]`` (one step's)."""
        m, p = self.model, self.params
        L, H, d = m.num_layers, rows["H"], m.head_dim
        c = rows["c"][sl]
        comp = 0.0
        if "att" in rows:
            att = float(rows["att"][sl].sum()) * L
            if "comp" in rows:
                comp = float(sum(x[sl].sum() for x in rows["comp"])) * L
        else:
            att = float(rows["roof"][sl].sum()) + L * c.size * p.kernel_launch_s
        if self.compress and comp == 0.0:
            peak, bw = self.gpu.bf16_flops * p.roofline_attn_eff, self.gpu.mem_bandwidth * p.roofline_bw_eff
            w = np.minimum(p.score_window, c)
            score_flops = 4.0 * d * self.gq * w * c * L * H  # window queries x new keys, QK^T and pooling/sum
            kept = rows["kept"][sl]
            sel_bytes = 2.0 * 4 * L * H * c  # fp32 scores written and read by top-k
            scatter_bytes = 2.0 * kept * self.tok_head_bytes  # kept K/V read from the chunk and written to pages
            comp = float((np.maximum(score_flops / peak, sel_bytes / bw) + scatter_bytes / bw).sum()) \
                + 3 * L * c.size * p.kernel_launch_s
        return att, comp

    def _dynamic(self, plan: StepPlan) -> tuple[np.ndarray, float]:
        """Global top-k realises its own per-head counts; pages beyond them are reclaimed on the host."""
        kp = plan.num_prefill
        realized = drawn_keep(self.profile, self.layout, self.seed, plan)  # [kp, L, H]
        after = self.layout.pages_for(self.layout.table_lens(plan.prefill_head_lens + realized)).sum(axis=1)
        reclaimed = np.maximum(0, plan.prefill_pages.sum(axis=1) - after)
        cost = float(reclaimed.sum()) * self.host.reclaim_page_s + kp * self.host.compress_row_s
        return realized, cost

    def _page_copy(self, pages: int) -> float:
        """One index copy of whole pages: every byte read and written once, at the measured device-copy bandwidth
        (meta.json ``copy_gbps``, bytes read + written per second), else the roofline's."""
        if "page_copy" not in self.sources:  # listed once used, so runs without shared prefixes are unchanged
            bw = self.tables.copy_bandwidth()
            self._copy_bw = bw if bw is not None else self.gpu.mem_bandwidth * self.params.roofline_bw_eff
            self.sources["page_copy"] = ("2 x page bytes / measured copy bandwidth (meta.json) + launch"
                                         if bw is not None else
                                         f"2 x page bytes / ({self.params.roofline_bw_eff:g} x datasheet HBM "
                                         f"bandwidth) + launch")
        return 2.0 * pages * self.layout.page_bytes / self._copy_bw + self.params.kernel_launch_s

    # ------------------------------------------------------------------ host
    def _host(self, c: dict) -> float:
        h = self.host
        T = c.get("tables", 1)
        return (h.step_s + (h.decode_row_s + h.decode_row_table_s * T) * c.get("decode_rows", 0)
                + (h.prefill_row_s + h.prefill_row_table_s * T) * c.get("prefill_rows", 0)
                + h.row_touched_s * c.get("rows_touched", 0)
                + h.page_s * (c.get("pages_allocated", 0) + c.get("pages_freed", 0))
                + h.admit_s * c.get("admitted", 0) + h.evict_s * c.get("evicted", 0)
                + h.preempt_s * c.get("preempted", 0))

    def describe(self) -> dict:
        m = self.tables.meta
        cal = None if self.tables.directory is None else {
            "dir": str(self.tables.directory.relative_to(self.tables.directory.parents[2]))
            if len(self.tables.directory.parents) > 2 else str(self.tables.directory),
            "date": m.get("date"), "command": m.get("command"), "gpu": m.get("gpu_name"),
            "provenance": [p["label"] for p in self.tables.provenance]}
        return {"sources": dict(sorted(self.sources.items())), "n_cta": self.n_cta, "tables": cal,
                "decode_bandwidth_bytes_per_s": self.dec_bw, "params": asdict(self.params),
                "host": asdict(self.host)}
