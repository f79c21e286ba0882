"""H100 correctness check before timing: Llama-3.1-8B's layer shape (4 of its 32 layers), random fp32 weights,
the Triton kernels (fp32 runs them in IEEE precision, so a layout bug cannot hide behind bf16 noise).

full mode through the executor (chunked prefill + paged decode, 2 sessions x 2 turns, batched) against the
plain model (unpaged SDPA) on the same token streams: max |dlogits| / max |logits| and greedy agreement.
Then a few steps of every mode, checking the logits stay finite (the KV pool is NaN-poisoned, so a read of an
unwritten slot would show), and every mode again with decode CUDA graphs off: the graph-replayed decode steps
(3 sessions decode together, so bucket 4 has a padded row) must give the eager logits. Writes a JSON summary to
argv[1].
"""
import json
import os
import sys
import time

import torch

from tangram.budgets import synthetic_profile
from tangram.config import MODES, EngineConfig, get_model
from tangram.engine.executor import Executor, ExecutorOptions, TimedScheduler, TokenSource
from tangram.engine.model import Session
from tangram.engine.weights import load_model
from tangram.harness import Cluster
from tangram.traces.format import Trace, Turn

out = {}
t = time.time()
import dataclasses
cfg = dataclasses.replace(get_model("llama-3.1-8b"), num_layers=4)
DEV = os.environ.get("DEVICE", "cuda")  # DEVICE=cpu NUM_LAYERS=1: a smoke test of this script on the CPU
cfg = dataclasses.replace(cfg, num_layers=int(os.environ.get("NUM_LAYERS", cfg.num_layers)))
GRAPHS = "auto" if DEV == "cuda" else "emulate"
model, _ = load_model(cfg, "random", dtype=torch.float32, device=DEV, seed=0)
out["load_s"] = time.time() - t
prof = synthetic_profile(cfg.num_layers, cfg.num_kv_heads, 0.25, alpha=2.0, seed=0, model=cfg.name)
trace = Trace([Turn("a:0", "a", 0, 0.0, 0.0, 700, 6), Turn("a:1", "a", 1, None, 0.0, 90, 5),
               Turn("b:0", "b", 0, 0.0, 0.0, 300, 8), Turn("b:1", "b", 1, None, 0.0, 40, 4),
               Turn("c:0", "c", 0, 0.0, 0.0, 200, 9), Turn("c:1", "c", 1, None, 0.0, 30, 6)])
NTURNS = len(trace.turns)


def serve(mode, cuda_graphs):
    eng = EngineConfig(mode=mode, chunk_size=256, max_batched_tokens=512,
                       kv_pool_bytes=int(float(os.environ.get("POOL_GIB", 2)) * 2**30))
    sched = TimedScheduler(cfg, eng, prof, pool_bytes=eng.kv_pool_bytes)
    exe = Executor(model, sched, TokenSource(cfg.vocab, seed=1),
                   ExecutorOptions(record_logits=True, cuda_graphs=cuda_graphs))
    return sched, exe, Cluster(trace, [(sched, exe)]).run()


for mode in MODES:
    sched, exe, res = serve(mode, GRAPHS)
    r = {"finished": sum(x.status == "finished" for x in res.records), "pages_in_use": sched.pool.n_used,
         "finite": all(bool(torch.isfinite(lg).all()) for _, _, lg in exe.logit_log), "n_occ": exe.n_occ}
    if exe.graphs is not None:
        r["graph_replays"], r["graph_keys"] = exe.graphs.stats.replays, exe.graphs.stats.keys
        s2, e2, res2 = serve(mode, "off")
        ref = {(rid, pos): lg for rid, pos, lg in e2.logit_log}
        got = {(rid, pos): lg for rid, pos, lg in exe.logit_log}
        r["graph_vs_eager_rel_err"] = max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref) \
            if got.keys() == ref.keys() else float("inf")
        r["graph_vs_eager_same_tokens"] = exe.streams == e2.streams
    if mode == "full":
        worst, agree, n = 0.0, 0, 0
        for sid, stream in exe.streams.items():
            with torch.no_grad():
                ref = Session(model).forward(torch.tensor(stream, device=DEV)).float().cpu()
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
ok = out["full"]["rel_err"] < 1e-3 and all(out[m]["finite"] and out[m]["pages_in_use"] == 0
                                           and out[m]["finished"] == NTURNS for m in MODES)
graphs_ok = all(out[m].get("graph_vs_eager_rel_err", 0.0) < 1e-4 and out[m].get("graph_replays", 1) > 0
                for m in MODES)
print("GRAPHS", "ok" if graphs_ok else "FAILED")
print("CHECK", "ok" if ok else "FAILED")
