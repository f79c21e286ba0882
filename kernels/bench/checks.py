"""Correctness of every kernel on realistic shapes against the float64 references, before anything is timed."""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from tangram.budgets import head_groups, synthetic_profile
from tangram.config import get_model
from tangram.engine.split_table import AotSplitTable
from tangram.kernels import decode as dec
from tangram.kernels import prefill as pre
from tangram.kernels.reference import (
    is_topk_set, ref_paged_decode, ref_prefill_attention, ref_scatter, ref_snapkv_scores, ref_topk_keep,
)

from .cases import layer_lens, ragged_tables, runtime_step_plan
from .timing import log


class Checks:
    """Mixin of :class:`tangram.kernels.bench.Bench`: ``checks()`` fills ``meta["checks"]``."""

    def checks(self):
        res = self.meta["checks"]
        m = get_model("llama-3.1-8b")
        g = torch.Generator(device=self.dev).manual_seed(int.from_bytes(os.urandom(4), "little"))
        P = 16
        for dtype in (torch.bfloat16, torch.float16):
            for Hp in (1, 4):
                prof = synthetic_profile(2, m.num_kv_heads, 0.25, seed=int(time.time()) % 1000)
                B, ctx = 4, 4096
                perm = head_groups(prof.B, Hp)
                lens_slot = layer_lens(prof.B, perm, ctx)[1]
                lens_slot[0] = 0 if Hp == 1 else lens_slot[0]
                pool = torch.randn(8192 // Hp * 4 + 64, 2, Hp, P, m.head_dim, device=self.dev, generator=g).to(dtype)
                bt = ragged_tables(lens_slot, B, Hp, P, pool.shape[0], self.dev)
                lens = torch.from_numpy(np.tile(lens_slot, (B, 1)).astype(np.int32)).to(self.dev)
                s2h = torch.from_numpy(perm[1].astype(np.int32)).to(self.dev)
                q = torch.randn(B, m.num_q_heads, m.head_dim, device=self.dev, generator=g).to(dtype)
                ref = ref_paged_decode(q, pool, bt, lens, s2h, page_size=P, heads_per_group=Hp)
                table = AotSplitTable(prof.B, perm, Hp, n_occ=self.n_occ or 528, max_batch=8, device=self.dev,
                                      **self.split_kwargs(m))
                variants = {
                    "tangram_aot": lambda o: dec.launch_decode(q, pool, bt, lens, s2h, table.lookup(1, B, ctx),
                                                               page_size=P, heads_per_group=Hp, out=o,
                                                               config=self.config),
                    "runtime_plan": lambda o: dec.launch_decode(
                        q, pool, bt, lens, s2h, runtime_step_plan(lens.cpu().numpy()[:, None, :], 528, self.dev)[0],
                        page_size=P, heads_per_group=Hp, out=o, config=self.config),
                    "static_split": lambda o: dec.static_split_decode(q, pool, bt, lens, s2h, page_size=P,
                                                                      heads_per_group=Hp, max_len=int(lens.max()),
                                                                      num_sms=self.num_sms, out=o, config=self.config),
                }
                for name, fn in variants.items():
                    o = torch.full_like(q, float("nan"))
                    fn(o)
                    err = float((o.double() - ref).norm() / ref.norm())
                    ok = bool(torch.isfinite(o).all()) and err < 1e-2
                    res[f"decode/{name}/{str(dtype)[6:]}/Hp{Hp}"] = {"rel_err": err, "ok": ok}
                    log(f"check decode {name:13s} {str(dtype)[6:]:9s} H_p={Hp}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
        # monolithic strided view (one kernel, both layouts)
        H, d = m.num_kv_heads, m.head_dim
        pool6 = torch.randn(300, 3, 2, H, P, d, device=self.dev, generator=g).to(torch.bfloat16)
        bt2 = torch.randperm(300, device=self.dev)[:4 * 64].view(4, 64).to(torch.int32)
        lens = torch.randint(0, 64 * P + 1, (4, H), device=self.dev, generator=g).to(torch.int32)
        q = torch.randn(4, m.num_q_heads, d, device=self.dev, generator=g).to(torch.bfloat16)
        pool, bt = dec.monolithic_layer_view(pool6, bt2, 1)
        ident = torch.arange(H, dtype=torch.int32, device=self.dev)
        ref = ref_paged_decode(q, pool, bt, lens, ident, page_size=P, heads_per_group=H)
        o = torch.full_like(q, float("nan"))
        dec.static_split_decode(q, pool, bt, lens, ident, page_size=P, heads_per_group=H, max_len=64 * P,
                                num_sms=self.num_sms, out=o, config=self.config)
        err = float((o.double() - ref).norm() / ref.norm())
        res["decode/static_split/monolithic"] = {"rel_err": err, "ok": bool(torch.isfinite(o).all()) and err < 1e-2}
        log(f"check decode monolithic view: rel err {err:.2e}")
        # prefill + compression, llama shape, ragged H_p = 4
        for mode in ("tangram", "dynamic"):
            c, Hp = 1024, 4
            G = H // Hp
            cached = torch.tensor([0, 15, 16, 17, 700, 1500, 2048, 333], dtype=torch.int32, device=self.dev)
            maxp = (2048 + c) // P + 2
            pool = torch.randn(G * maxp + 8, 2, Hp, P, d, device=self.dev, generator=g).to(torch.bfloat16)
            btp = torch.randperm(pool.shape[0], device=self.dev)[:G * maxp].view(G, maxp).to(torch.int32)
            s2h = torch.randperm(H, device=self.dev, generator=g).to(torch.int32)
            qc = torch.randn(c, m.num_q_heads, d, device=self.dev, generator=g).to(torch.bfloat16)
            kn = torch.randn(c, H, d, device=self.dev, generator=g).to(torch.bfloat16)
            vn = torch.randn(c, H, d, device=self.dev, generator=g).to(torch.bfloat16)
            ratios = np.linspace(0.05, 1.0, H)
            counts, gk = pre.keep_budget(mode, c, H, ratios=ratios, rho=0.25)
            ro, probs = ref_prefill_attention(qc, kn, vn, pool, btp, cached, s2h, page_size=P, heads_per_group=Hp)
            rs = ref_snapkv_scores(probs, cached, s2h, window=32)
            pool2, lens2 = pool.clone(), cached.clone()
            r = pre.prefill_compress(qc, kn, vn, pool2, btp, lens2, s2h, page_size=P, heads_per_group=Hp,
                                     keep_counts=counts, global_keep=gk)
            e_o = float((r.out.double() - ro).norm() / ro.norm())
            e_s = float((r.scores.double() - rs).norm() / rs.norm())
            s = r.scores.double().cpu().numpy()
            keep = r.keep.cpu().numpy()
            same = bool(np.array_equal(keep, ref_topk_keep(s, counts, gk)))
            topk = is_topk_set(s, keep, r.counts.cpu().numpy())
            rpool, rlens = ref_scatter(pool, btp, cached, s2h, kn, vn, keep, page_size=P, heads_per_group=Hp)
            scat = bool(torch.equal(pool2, rpool) and torch.equal(lens2, rlens))
            ok = e_o < 1e-2 and e_s < 1e-2 and same and topk and scat and bool(torch.isfinite(r.out).all())
            res[f"prefill/{mode}"] = {"out_rel_err": e_o, "score_rel_err": e_s, "topk_equal": same, "is_topk": topk,
                                      "scatter_exact": scat, "ok": ok}
            log(f"check prefill {mode}: out {e_o:.2e} scores {e_s:.2e} topk {same}/{topk} scatter {scat}")
        self.save_meta()

    # -- tile choice and occupancy
