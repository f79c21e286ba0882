"""H100 correctness check before timing: Llama-3.1-8B's layer shape (4 of its 32 layers), random fp32 weights,
the Triton kernels (fp32 runs them in IEEE precision, so a layout bug cannot hide behind bf16 noise).

full mode through the executor (chunked prefill + paged decode, 2 sessions x 2 turns, batched) against the
plain model (unpaged SDPA) on the same token streams: max |dlogits| / max |logits| and greedy agreement.
Then a few steps of every mode, checking the logits stay finite (the KV pool is NaN-poisoned, so a read of an
unwritten slot would show). Writes a JSON summary to argv[1].
"""
import json
import sys
import time

import torch

from tangram.budgets import synthetic_profile
from tangram.config import MODES, EngineConfig, get_model
from tangram.engine.executor import Executor, ExecutorOptions, TimedScheduler, TokenSource
from tangram.engine.model import Session
from tangram.engine.weights import load_model
from tangram.sim.cluster import Cluster
from tangram.traces.format import Trace, Turn

out = {}
t = time.time()
import dataclasses
cfg = dataclasses.replace(get_model("llama-3.1-8b"), num_layers=4)
model, _ = load_model(cfg, "random", dtype=torch.float32, device="cuda", seed=0)
out["load_s"] = time.time() - t
prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.25, alpha=2.0, seed=0, model=cfg.name)
trace = Trace([Turn("a:0", "a", 0, 0.0, 0.0, 700, 6), Turn("a:1", "a", 1, None, 0.0, 90, 5),
               Turn("b:0", "b", 0, 0.0, 0.0, 300, 8), Turn("b:1", "b", 1, None, 0.0, 40, 4)])
for mode in MODES:
    eng = EngineConfig(mode=mode, chunk_size=256, max_batched_tokens=512, kv_pool_bytes=2 * 2**30)
    sched = TimedScheduler(cfg, eng, prof, pool_bytes=eng.kv_pool_bytes)
    exe = Executor(model, sched, TokenSource(cfg.vocab, seed=1), ExecutorOptions(record_logits=True))
    res = Cluster(trace, [(sched, exe)]).run()
    r = {"finished": sum(x.status == "finished" for x in res.records), "pages_in_use": sched.pool.n_used,
         "finite": all(bool(torch.isfinite(lg).all()) for _, _, lg in exe.logit_log), "n_occ": exe.n_occ}
    if mode == "full":
        worst, agree, n = 0.0, 0, 0
        for sid, stream in exe.streams.items():
            with torch.no_grad():
                ref = Session(model).forward(torch.tensor(stream, device="cuda")).float().cpu()
            rids = {x.rid for x in res.records if x.session_id == sid}
            for rid, pos, lg in exe.logit_log:
                if rid in rids:
                    worst = max(worst, float((lg - ref[pos]).abs().max() / ref[pos].abs().max()))
                    agree += int(lg.argmax() == ref[pos].argmax())
                    n += 1
        r.update(rel_err=worst, greedy_agree=agree / n, rows=n)
    out[mode] = r
    print(mode, r, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
ok = out["full"]["rel_err"] < 1e-3 and all(out[m]["finite"] and out[m]["pages_in_use"] == 0 and out[m]["finished"] == 4
                                           for m in MODES)
print("CHECK", "ok" if ok else "FAILED")
