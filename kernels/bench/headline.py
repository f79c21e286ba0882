"""Tile choice and the headline comparisons: uniform full-KV decode against FlashInfer, skewed non-uniform
decode (AOT split table vs the static and runtime baselines), each point checked against the float64 reference."""
from __future__ import annotations

import json
import math
from dataclasses import asdict

import numpy as np
import torch

from tangram.budgets import constant_profile, synthetic_profile
from tangram.config import get_model
from tangram.engine.split_table import AotSplitTable
from tangram.kernels import decode as dec
from tangram.kernels.reference import ref_paged_decode

from .cases import DecodeCase, MonoCase
from .timing import L2_BYTES, log, time_graph, time_graphs, time_host


class Headline:
    """Mixin of :class:`tangram.kernels.bench.Bench`: ``choose_config``, ``decode_point``, ``headline``."""

    def choose_config(self, arena):
        m = get_model("llama-3.1-8b")
        B1 = constant_profile(m.num_layers, m.num_kv_heads, 1.0).B
        case = DecodeCase(arena, m, 16, 8192, 1.0, m.num_kv_heads, 0, 16, B1, n_calls=2)
        cands = [dec.DecodeConfig(64, 4, 2), dec.DecodeConfig(64, 4, 3), dec.DecodeConfig(128, 4, 2),
                 dec.DecodeConfig(128, 8, 3), dec.DecodeConfig(32, 4, 4), dec.DecodeConfig(64, 8, 4)]
        if self.args.quick:
            cands = cands[:3]
        tile = getattr(self.args, "tile", "auto")
        if tile == "engine":  # the tile the engine launches: its rows and occupancy are the engine's
            cands = [dec.DEFAULT_CONFIG]
        elif tile != "auto":
            cands = [dec.DecodeConfig(*map(int, tile.split("x")))]
        best = None
        for cfg in cands:
            try:
                table = AotSplitTable(B1, case.perm, case.Hp, n_occ=2 * self.num_sms, max_batch=16,
                                      device=self.dev)
                fn, _, _ = case.aot(table, cfg)
                med, *_ = time_graph(fn)
                res = dec.kernel_resources(cfg)
                log(f"config {asdict(cfg)}: {med / case.n_calls * 1e3:.1f} us/layer, resources {res}")
                if best is None or med < best[0]:
                    best = (med, cfg)
            except Exception as e:  # noqa: BLE001
                log(f"config {cfg} failed: {e!r}")
        self.config = best[1]
        res = dec.kernel_resources(self.config)
        lim = dec.device_limits(self.dev)
        self.n_occ = dec.decode_n_cta(res, lim)
        self.meta["decode_kernel"] = {**asdict(self.config), "n_regs": res.n_regs, "shared_bytes": res.shared_bytes,
                                      "num_warps": res.num_warps,
                                      "blocks_per_sm": dec.occupancy_blocks_per_sm(res, lim), "n_cta": self.n_occ,
                                      "limits": asdict(lim)}
        log(f"chosen {asdict(self.config)}; N_CTA = {self.n_occ} ({self.meta['decode_kernel']['blocks_per_sm']}/SM)")
        self.save_meta()

    # -- one decode point, all variants
    def decode_point(self, table_out, arena, m, batch, ctx, rho, Hp, seed, kernels, tables_cache, waves=None,
                     fi_tc=(True,), check=False, min_calls=1):
        P = 16
        if rho >= 1.0:
            Bratio = constant_profile(m.num_layers, m.num_kv_heads, 1.0).B
        else:
            Bratio = synthetic_profile(m.num_layers, m.num_kv_heads, rho, seed=seed).B
        per_layer = batch * m.num_kv_heads * ctx * 2 * m.head_dim * 2 * float(Bratio.mean())
        n_calls = int(min(2 * m.num_layers, max(min_calls, math.ceil(4 * L2_BYTES / max(per_layer, 1)))))
        try:
            case = DecodeCase(arena, m, batch, ctx, rho, Hp, seed, P, Bratio, n_calls)
        except MemoryError:
            return {}
        waves = self.waves if waves is None else waves
        base = dict(dtype="bfloat16", model=m.name, batch=batch, num_q_heads=m.num_q_heads,
                    num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, page_size=P, rho=rho,
                    profile_seed=seed if rho < 1 else "", context=ctx, n_calls=n_calls, kv_tokens=case.kv_tokens,
                    bytes=case.bytes, n_cta=self.n_occ)
        out = {}
        ref = []
        pending = []  # (kernel, fn, plan_ms, hp, extra): the Triton variants, timed together (interleaved replays)

        def record(kernel, fn, plan_ms, hp, impl="triton", ctas="", max_splits="", w="", calls=None, ref_fn=None,
                   timed=None):
            if timed is None:
                case.out[0].fill_(float("nan"))
                timed = time_graph(fn)
            med, p20, p80, timer = timed
            if check:  # run it once more on a poisoned output and compare call 0 with the float64 reference
                case.out[0].fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                if ref_fn is not None:
                    r0 = ref_fn()
                else:
                    if not ref:
                        ref.append(ref_paged_decode(case.q[0], case.pool, case.bt[0], case.lens_t[0], case.s2h[0],
                                                    page_size=P, heads_per_group=Hp))
                    r0 = ref[0]
                err = float((case.out[0].double() - r0).norm() / r0.norm())
                self.meta["checks"][f"point/{m.name}/B{batch}/ctx{ctx}/rho{rho}/Hp{Hp}/{kernel}/{impl}"] = {
                    "rel_err": err, "ok": bool(torch.isfinite(case.out[0]).all()) and err < 1e-2}
                log(f"check {kernel}/{impl} at B={batch} ctx={ctx} rho={rho} H_p={Hp}: rel err {err:.2e}")
            k = calls or n_calls
            med, p20, p80 = med / k, p20 / k, p80 / k
            tot = med + plan_ms
            row = dict(base, kernel=kernel, impl=impl, heads_per_group=hp, n_calls=k, median_ms=med, p20_ms=p20, p80_ms=p80,
                       plan_ms=plan_ms, total_ms=tot, achieved_gbps=case.bytes / (med * 1e-3) / 1e9, timer=timer,
                       ctas_launched=ctas, max_splits=max_splits, waves=w)
            if table_out is not None:
                table_out.add(**row)
            out[(kernel, impl)] = row
            return row

        # tangram_aot_lpt: the same maps launched longest piece first (AotSplitTable order="lpt"; its own kernel
        # name, so the decode-cost fit, which reads tangram_aot rows, stays on request-order launches)
        for kname, order in (("tangram_aot", "request"), ("tangram_aot_lpt", "lpt")):
            if kname not in kernels:
                continue
            for w in ([waves] if np.isscalar(waves) else waves):
                key = (m.name, rho, seed, Hp, w, order)
                if key not in tables_cache:
                    tables_cache[key] = AotSplitTable(Bratio, case.perm, Hp, self.n_occ, max_batch=256, waves=w,
                                                      device=self.dev, order=order, **self.split_kwargs(m))
                fn, plan_ms, scheds = case.aot(tables_cache[key], self.config)
                pending.append((kname, fn, plan_ms, Hp, dict(
                    impl=f"triton_w{w:g}" if not np.isscalar(waves) else "triton",
                    ctas=int(np.mean([s.n_items for s in scheds])) * batch,
                    max_splits=max(s.max_splits for s in scheds), w=w)))
        if "runtime_plan" in kernels:
            fn, plan_ms, scheds = case.runtime(self.n_occ, self.config)
            pending.append(("runtime_plan", fn, plan_ms, Hp, dict(ctas=int(np.mean([s.n_items for s in scheds])),
                                                                  max_splits=max(s.max_splits for s in scheds))))
        if "static_split_ragged" in kernels:  # the static heuristic on Tangram's own layout: partitioning alone
            ns = dec.static_split_num_splits(batch, m.num_kv_heads, int(case.lens_slot.max()), self.num_sms,
                                             m.head_dim)
            ssched = dec.static_schedule(m.num_kv_heads, ns, self.dev)

            def fn_sr():
                for i in range(n_calls):
                    dec.launch_decode(case.q[i], case.pool, case.bt[i], case.lens_t[i], case.s2h[i], ssched,
                                      page_size=P, heads_per_group=Hp, out=case.out[i], config=self.config)
            plan_sr = time_host(lambda: dec.static_split_num_splits(batch, m.num_kv_heads, int(case.lens_slot.max()),
                                                                    self.num_sms, m.head_dim)) / Bratio.shape[0]
            pending.append(("static_split_ragged", fn_sr, plan_sr, Hp, dict(ctas=ssched.n_items * batch,
                                                                             max_splits=ns)))
        if "static_split" in kernels:
            try:
                mono = MonoCase(arena, case)
                fn, plan_ms, sched = mono.static(self.num_sms, self.config)
                pool0, bt0 = dec.monolithic_layer_view(mono.pool6, mono.bt2, 0)
                pending.append(("static_split", fn, plan_ms, m.num_kv_heads, dict(
                    ctas=sched.n_items * batch, max_splits=sched.max_splits,
                    ref_fn=lambda: ref_paged_decode(case.q[0], pool0, bt0, mono.lens_t[0], mono.ident,
                                                    page_size=P, heads_per_group=m.num_kv_heads))))
            except MemoryError:
                pass
        # one interleaved timing of every Triton variant of the point: the ratios compare like with like
        for (kernel, fn, plan_ms, hp, kw), timed in zip(pending, time_graphs([x[1] for x in pending])):
            record(kernel, fn, plan_ms, hp, timed=timed, **kw)
        if "flashinfer" in kernels and self.fi is not None:
            for tc in fi_tc:
                try:
                    if Hp == m.num_kv_heads and rho >= 1.0:
                        fn, plan_ms, k = self.fi.uniform(case, tc)
                    elif Hp == 1:
                        fn, plan_ms, k = self.fi.ragged_hp1(case, tc)
                    else:
                        continue
                    record("flashinfer", fn, plan_ms, Hp, impl=f"flashinfer_tc{int(tc)}", calls=k)
                except Exception as e:  # noqa: BLE001
                    log(f"flashinfer failed: {e!r}")
                    self.meta["notes"].append(f"flashinfer failed at {m.name} B={batch} ctx={ctx}: {e!r}"[:300])
        # output check of this point against the first variant (cheap, catches a broken variant on big shapes)
        return out

    def headline(self, arena, dtab, tables_cache):
        m = get_model("llama-3.1-8b")
        H = m.num_kv_heads
        hl = self.meta["headline"]
        r = self.decode_point(dtab, arena, m, 16, 8192, 1.0, H, 0, ("tangram_aot", "static_split", "flashinfer"),
                              tables_cache, fi_tc=(True, False), check=True, min_calls=4)
        ours = r[("tangram_aot", "triton")]
        fis = [v for (k, _), v in r.items() if k == "flashinfer"]
        u = {"ours_ms": ours["median_ms"], "ours_gbps": ours["achieved_gbps"], "copy_gbps": self.meta["copy_gbps"],
             "ours_vs_copy": ours["achieved_gbps"] / self.meta["copy_gbps"]}
        if fis:
            fb = min(fis, key=lambda x: x["median_ms"])
            u.update(flashinfer_ms=fb["median_ms"], flashinfer_impl=fb["impl"], flashinfer_gbps=fb["achieved_gbps"],
                     ours_throughput_vs_flashinfer=fb["median_ms"] / ours["median_ms"])
        hl["uniform_b16_8k"] = u
        log(f"HEADLINE uniform B=16 8K: {json.dumps(u)}")
        self.save_meta()
        for batch in (16, 64):
            best = None
            for Hp in (1, 2, 4, 8):
                kern = ("tangram_aot", "runtime_plan", "static_split_ragged") + \
                    (("static_split",) if Hp == 1 else ()) + (("flashinfer",) if Hp == 1 else ())
                r = self.decode_point(dtab, arena, m, batch, 32768, 0.25, Hp, 0, kern, tables_cache,
                                      waves=(1.0, 2.0, 4.0), check=batch == 16, min_calls=8)
                aots = {k[1]: v for k, v in r.items() if k[0] == "tangram_aot"}
                if Hp == 1:
                    st = r[("static_split", "triton")]
                    fi = [v for (k, _), v in r.items() if k == "flashinfer"]
                rt = r[("runtime_plan", "triton")]
                sr = r[("static_split_ragged", "triton")]
                for impl, a in aots.items():
                    d = {"Hp": Hp, "waves": a["waves"], "aot_ms": a["total_ms"], "aot_gbps": a["achieved_gbps"],
                         "static_ms": st["total_ms"], "static_gbps": st["achieved_gbps"],
                         "runtime_ms": rt["total_ms"], "runtime_kernel_ms": rt["median_ms"],
                         "runtime_plan_ms": rt["plan_ms"], "vs_static": st["total_ms"] / a["total_ms"],
                         "vs_runtime": rt["total_ms"] / a["total_ms"], "static_ragged_ms": sr["total_ms"],
                         "vs_static_ragged": sr["total_ms"] / a["total_ms"]}
                    if fi:
                        f = min(fi, key=lambda x: x["total_ms"])
                        d.update(flashinfer_hp1_ms=f["total_ms"], flashinfer_hp1_plan_ms=f["plan_ms"])
                    hl[f"skew_b{batch}_32k_Hp{Hp}_{impl}"] = d
                    log(f"HEADLINE skew B={batch} 32K rho=.25 H_p={Hp} {impl}: aot {a['total_ms'] * 1e3:.1f} us "
                        f"({a['achieved_gbps']:.0f} GB/s), static {st['total_ms'] * 1e3:.1f}, runtime "
                        f"{rt['median_ms'] * 1e3:.1f}+{rt['plan_ms'] * 1e3:.1f} -> x{d['vs_static']:.2f} / "
                        f"x{d['vs_runtime']:.2f}")
                    if best is None or a["total_ms"] < best[0]:
                        best = (a["total_ms"], a["waves"])
            hl[f"best_waves_b{batch}"] = best[1]
        # the sweep uses the waves that won most often
        ws = [hl.get("best_waves_b16", 1.0), hl.get("best_waves_b64", 1.0)]
        self.waves = max(set(ws), key=ws.count)
        self.meta["aot_waves"] = self.waves
        # repeat the skewed H_p = 1 points on fresh random pages: the run-to-run spread of each ratio
        for batch in (16, 64):
            r = self.decode_point(None, arena, m, batch, 32768, 0.25, 1, 0,
                                  ("tangram_aot", "runtime_plan", "static_split", "static_split_ragged"),
                                  tables_cache, min_calls=8)
            a, st, rt = r[("tangram_aot", "triton")], r[("static_split", "triton")], r[("runtime_plan", "triton")]
            hl[f"repeat_skew_b{batch}_32k_Hp1_w{self.waves:g}"] = {
                "aot_ms": a["total_ms"], "aot_gbps": a["achieved_gbps"], "static_ms": st["total_ms"],
                "static_gbps": st["achieved_gbps"], "runtime_ms": rt["total_ms"], "runtime_plan_ms": rt["plan_ms"],
                "vs_static": st["total_ms"] / a["total_ms"], "vs_runtime": rt["total_ms"] / a["total_ms"],
                "vs_static_ragged": r[("static_split_ragged", "triton")]["total_ms"] / a["total_ms"]}
            log(f"REPEAT skew B={batch}: {json.dumps(hl[f'repeat_skew_b{batch}_32k_Hp1_w{self.waves:g}'])}")
        self.save_meta()

