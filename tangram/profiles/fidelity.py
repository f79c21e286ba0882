"""Fidelity of the serving modes on the real model: ``python -m tangram.profiles.fidelity``.

Runs held-out multi-turn samples through SmolLM2 under ``full``, ``uniform``,
``dynamic`` (Ada-SnapKV layer-wide top-k per chunk) and ``tangram`` (per-head
top-ceil(B*C) per chunk from a calibrated profile; H_p=1, and group-max budgets
with H_p=3 clustered) and writes ``report.md`` + PNGs.

Compression is applied per prefill chunk, as the engine does: after a chunk of
C new tokens has been computed, each head keeps its selected subset of those
tokens; decoded tokens are always kept. Metrics per turn:

* agreement: teacher-forced greedy agreement with ``full``'s answer tokens
  (each mode predicts every answer token given ``full``'s previous ones, so
  later turns share one history and stay comparable);
* attention mass retained: over the answer queries, the share of the
  uncompressed softmax attention mass that falls on kept tokens;
* overflow: share of (chunk, layer, head) where the dynamic method would keep
  more tokens than the static budget ceil(B*C) (chunks of >= 64 tokens);
* accuracy: the mode's own free greedy answer contains the known answer.
"""
from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tangram.budgets import BudgetProfile, group_budgets, head_groups
from tangram.profiles.corpus import TASKS, Sample, answer_correct, build_corpus, make_sample
from tangram.profiles.scoring import (ChunkScorer, budget_tokens, global_topk_mask, make_scorer,
                                         per_head_topk_mask)
from tangram.engine.model import AttnEvent, Session, TorchAttention
from tangram.errors import ConfigError
from tangram.cli import Parser, check_at_least, cli_main, output_dir

OVERFLOW_MIN_CHUNK = 64


@dataclass
class ModeSpec:
    label: str
    kind: str  # full | uniform | dynamic | tangram
    rho: float = 1.0
    budgets: np.ndarray | None = None  # [L, H] effective per-head ratios for tangram
    heads_per_group: int = 1

    def select(self, scores: torch.Tensor) -> torch.Tensor | None:
        """Keep mask [L, H, T] for a chunk's scores [L, H, T]; None keeps everything."""
        if self.kind == "full":
            return None
        if self.kind == "uniform":
            return per_head_topk_mask(scores, self.rho)
        if self.kind == "dynamic":
            return global_topk_mask(scores, self.rho)
        return per_head_topk_mask(scores, self.budgets)


def tangram_budgets(profile: BudgetProfile, heads_per_group: int) -> np.ndarray:
    """Per-head ratios the pages give: each head gets its group's largest budget (clustered grouping)."""
    B = profile.B
    if heads_per_group == 1:
        return B
    perm = head_groups(B, heads_per_group, clustered=True)
    gb = group_budgets(B, perm, heads_per_group)  # [L, G]
    eff = np.empty_like(B)
    L, H = B.shape
    np.put_along_axis(eff, perm, np.repeat(gb, heads_per_group, axis=1), axis=1)
    return eff


class MassMeter:
    """Observer: attention mass on kept tokens under the uncompressed softmax, for the current queries."""

    def __init__(self) -> None:
        self.enabled = False
        self.total, self.count = 0.0, 0

    def __call__(self, ev: AttnEvent) -> None:
        if not self.enabled:
            return
        g = ev.q.shape[1] // ev.k.shape[1]
        causal = (ev.k_pos[None, :] <= ev.q_pos[:, None])[None, None]  # [1, 1, T, N]
        s = torch.einsum("bhtd,bhnd->bhtn", ev.q.float(), ev.k.float().repeat_interleave(g, dim=1)) * ev.scale
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        kept = (p * ev.keep.repeat_interleave(g, dim=1)[:, :, None, :]).sum(-1)
        self.total += float(kept.sum())
        self.count += kept.numel()

    def take(self) -> float:
        m = self.total / max(self.count, 1)
        self.total, self.count = 0.0, 0
        return m


@dataclass
class RunState:
    sess: Session
    scorer: ChunkScorer
    meter: MassMeter


def _fresh(model, method: str, window: int | None, tok=None) -> RunState:
    scorer, meter = make_scorer(method, model.cfg.num_layers, window, tokenizer=tok), MassMeter()
    return RunState(Session(model, TorchAttention(model.cfg, observers=[scorer, meter])), scorer, meter)


def _clone(st: RunState) -> RunState:
    b = st.sess.backend
    nb = TorchAttention(b.cfg, observers=[])
    nb.k, nb.v, nb.pos = list(b.k), list(b.v), b.pos
    nb.keep = [None if t is None else t.clone() for t in b.keep]
    scorer, meter = copy.copy(st.scorer), MassMeter()
    scorer.scores = list(st.scorer.scores)
    nb.observers = [scorer, meter]
    return RunState(Session(st.sess.model, nb), scorer, meter)


@dataclass
class SpecStats:
    agree: list[float] = field(default_factory=list)
    mass: list[float] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    overflow: list[float] = field(default_factory=list)  # per scored chunk: share of heads overflowing
    kept: list[float] = field(default_factory=list)  # kept share of prefill tokens per chunk


def _compress(st: RunState, spec: ModeSpec, start: int, scores: torch.Tensor, stats: SpecStats) -> None:
    T = scores.shape[-1]
    mask = spec.select(scores)
    if spec.kind == "tangram" and T >= OVERFLOW_MIN_CHUNK:
        dyn = global_topk_mask(scores, spec.rho).sum(-1).cpu().numpy()  # [L, H] dynamic method's counts
        stats.overflow.append(float((dyn > budget_tokens(spec.budgets, T)).mean()))
    if mask is None:
        stats.kept.append(1.0)
        return
    stats.kept.append(float(mask.float().mean()))
    for l in range(mask.shape[0]):
        st.sess.backend.evict(l, start, mask[l][None])


def _prefill(st: RunState, spec: ModeSpec, tokens: list[int], chunk: int, stats: SpecStats,
             first_done: torch.Tensor | None = None) -> torch.Tensor:
    """Chunked prefill with per-chunk compression; returns the last token's logits."""
    logits = first_done
    a = 0
    if first_done is not None:  # the first chunk was computed before cloning
        start = st.sess.length - min(chunk, len(tokens))
        st.scorer.after_chunk(st.sess, tokens[:chunk])  # KVzip's reconstruction forward; a no-op for the others
        _compress(st, spec, start, st.scorer.take()[:, 0], stats)
        a = min(chunk, len(tokens))
    while a < len(tokens):
        piece = tokens[a:a + chunk]
        start = st.sess.length
        logits = st.sess.forward(piece, last_only=True)[-1]
        if len(piece) >= st.scorer.min_tokens:
            st.scorer.after_chunk(st.sess, piece)
            _compress(st, spec, start, st.scorer.take()[:, 0], stats)
        a += chunk
    return logits


def turn_tokens(tok, sample: Sample, t: int) -> list[int]:
    if t == 0:
        return tok.apply_chat([{"role": "user", "content": sample.user_message(0)}], add_generation_prompt=True)
    return tok.encode(f"\n<|im_start|>user\n{sample.user_message(t)}<|im_end|>\n<|im_start|>assistant\n")


@torch.no_grad()
def run_sample(model, tok, sample: Sample, specs: list[ModeSpec], *, chunk: int, max_new: int, method: str,
               window: int | None, stats: dict[str, SpecStats]) -> None:
    """All specs on one sample; ``specs[0]`` must be ``full`` (its greedy answers are the reference)."""
    assert specs[0].kind == "full"
    eos = tok.eos_id
    turns = [turn_tokens(tok, sample, t) for t in range(len(sample.turns))]
    base = _fresh(model, method, window, tok)
    first = base.sess.forward(turns[0][:chunk], last_only=True)[-1]
    refs: list[list[int]] = []
    for spec in specs:
        st = _clone(base)
        s = stats[spec.label]
        for t, toks in enumerate(turns):
            logits = _prefill(st, spec, toks, chunk, s, first_done=first if t == 0 else None)
            n0 = st.sess.length
            gen = st.sess.generate(logits, max_new, (eos,))
            st.sess.backend.truncate(n0)
            s.correct.append(answer_correct(tok.decode(gen, skip_special=True), sample.turns[t].answer))
            if spec.kind == "full":
                refs.append(gen)
            gen_ref = refs[t]
            ref = gen_ref if gen_ref[-1] == eos else gen_ref + [eos]  # history always closes the turn
            st.meter.enabled = True
            st.scorer.enabled = False
            lg = st.sess.forward(ref)
            st.meter.enabled = False
            st.scorer.enabled = True
            preds = torch.cat([logits.argmax()[None], lg[:-1].argmax(-1)])[:len(gen_ref)]
            s.agree.append(float((preds == torch.as_tensor(gen_ref)).float().mean()))
            s.mass.append(st.meter.take())


# --------------------------------------------------------------------------- report


def _spearman_tables(ret: dict[str, np.ndarray]) -> tuple[list[tuple], list[tuple]]:
    from scipy.stats import spearmanr
    names = list(ret)
    flat, layer = [], []
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            a, b = ret[names[i]].mean(0), ret[names[j]].mean(0)  # [L, H]
            flat.append((names[i], names[j], float(spearmanr(a.ravel(), b.ravel()).statistic)))
            per = [spearmanr(a[l], b[l]).statistic for l in range(a.shape[0])]
            per = [p for p in per if np.isfinite(p)]
            layer.append((names[i], names[j], float(np.mean(per)) if per else float("nan")))
    return flat, layer


def plot_boxes(ret: dict[str, np.ndarray], profile: BudgetProfile, layers: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    B = profile.B
    tasks = list(ret)
    fig, axes = plt.subplots(1, len(layers), figsize=(4.2 * len(layers), 3.6), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, l in zip(axes[0], layers):
        order = np.argsort(B[l], kind="stable")
        H = len(order)
        wid = 0.8 / len(tasks)
        for ti, task in enumerate(tasks):
            data = [100 * ret[task][:, l, h] for h in order]
            pos = np.arange(H) + (ti - (len(tasks) - 1) / 2) * wid
            bp = ax.boxplot(data, positions=pos, widths=wid * 0.9, patch_artist=True, showfliers=False)
            for b in bp["boxes"]:
                b.set_facecolor(colors[ti % len(colors)])
                b.set_alpha(0.6)
            ax.plot([], [], color=colors[ti % len(colors)], lw=6, alpha=0.6, label=task)
        for x, h in enumerate(order):
            ax.hlines(100 * B[l, h], x - 0.45, x + 0.45, colors="k", linestyles="--", lw=1)
        ax.set_xticks(range(H), [f"h{h}" for h in order])
        ax.set_title(f"layer {l}")
        ax.set_ylabel("retention (%)")
        ax.set_ylim(0, 105)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Per-head retention by task ({profile.method}, rho={profile.rho:g}); dashed: B (alpha={profile.alpha:g})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_agreement(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    kinds = sorted({r["mode"] for r in rows if r["mode"] != "full"})
    for k in kinds:
        rr = sorted((r for r in rows if r["mode"] == k), key=lambda r: r["rho"])
        axes[0].plot([r["rho"] for r in rr], [r["agreement"] for r in rr], "o-", label=k)
        axes[1].plot([r["rho"] for r in rr], [r["mass"] for r in rr], "o-", label=k)
    axes[0].set_ylabel("greedy agreement with full")
    axes[1].set_ylabel("attention mass retained")
    for ax in axes:
        ax.set_xlabel("rho")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _profile_path(pattern: str | None, model: str, method: str, rho: float) -> Path:
    """The profile of one rho: ``pattern`` with {rho} substituted, else the shipped per-layer calibration (found
    wherever the package is installed, not relative to the working directory)."""
    from tangram.profiles import registry
    if pattern is not None:
        return Path(pattern.replace("{rho}", f"{rho:g}"))
    path = registry.default_profile_path(model, method, "per-layer", rho)
    if path is None:
        raise ConfigError(f"no shipped {method} per-layer profile of {model} at rho {rho:g} in {registry.DATA_DIR}; "
                          "calibrate one (tangram-profile) and pass it with --profile")
    return path


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m tangram.profiles.fidelity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weights", default="auto")
    p.add_argument("--method", default="ada-snapkv")
    p.add_argument("--profile", default=None,
                   help="calibrated profile per rho ({rho} substituted; default: the shipped per-layer profile of "
                        "--model and --method at each rho, tangram.profiles.registry)")
    p.add_argument("--rhos", default="0.25,0.5,0.75")
    p.add_argument("--list-profiles", default=None,
                   help="glob of profiles summarised in the report (default: the shipped profiles of --model)")
    p.add_argument("--samples-per-task", type=int, default=2)
    p.add_argument("--box-samples-per-task", type=int, default=8, help="held-out samples per task for the box plots")
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--max-new", type=int, default=24)
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--box-layers", default="2,15,27")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("-o", "--out", default="reports/fidelity/agreement")
    return p


@cli_main
def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from tangram.profiles.retention import retention_samples
    from tangram.tokenizer import load_tokenizer
    from tangram.engine.weights import load_model
    args = build_parser().parse_args(argv)
    output_dir(args.out)  # before the hours of work, not after
    t_start = time.time()
    try:
        rhos = [float(x) for x in args.rhos.split(",")]
        box_layers = [int(x) for x in args.box_layers.split(",")]
    except ValueError:
        raise ConfigError("--rhos and --box-layers must be comma-separated numbers") from None
    if not rhos or not all(0 < r <= 1 for r in rhos):  # NaN fails the comparison too
        raise ConfigError(f"--rhos must be ratios in (0, 1], got {args.rhos!r}")
    from tangram.budgets import METHODS
    if args.method not in METHODS:
        raise ConfigError(f"--method: unknown scoring method {args.method!r}; choose from {', '.join(METHODS)}")
    check_at_least(("--samples-per-task", args.samples_per_task, 1),
                   ("--box-samples-per-task", args.box_samples_per_task, 1),
                   ("--context-tokens", args.context_tokens, 16), ("--chunk-size", args.chunk_size, 2),
                   ("--max-new", args.max_new, 1), ("--window", 1 if args.window is None else args.window, 1),
                   ("--threads", 1 if args.threads is None else args.threads, 1))
    from tangram.config import get_model
    from tangram.profiles import registry
    cfg = get_model(args.model)
    paths = {r: _profile_path(args.profile, cfg.name, args.method, r) for r in rhos}
    if args.threads:
        torch.set_num_threads(args.threads)
    model, info = load_model(args.model, args.weights)
    tok = load_tokenizer(info.get("gguf_path"))
    L, H = model.cfg.num_layers, model.cfg.num_kv_heads
    profiles = {r: BudgetProfile.load(paths[r]) for r in rhos}
    for r, pr in profiles.items():
        pr.check_model(L, H, model.cfg.name)
    hp_group = H  # H_p = H: one group per layer (SmolLM2 has 3 KV heads, so H_p=3)
    specs = [ModeSpec("full", "full")]
    for r in rhos:
        specs += [ModeSpec(f"uniform@{r:g}", "uniform", r), ModeSpec(f"dynamic@{r:g}", "dynamic", r),
                  ModeSpec(f"tangram-hp1@{r:g}", "tangram", r, tangram_budgets(profiles[r], 1), 1),
                  # memory-matched control: B = mu (alpha = 0) keeps about rho, like dynamic
                  ModeSpec(f"tangram-a0@{r:g}", "tangram", r, tangram_budgets(profiles[r].with_alpha(0.0), 1), 1),
                  ModeSpec(f"tangram-hp{hp_group}@{r:g}", "tangram", r, tangram_budgets(profiles[r], hp_group),
                           hp_group)]
    samples = [make_sample(task, "heldout", i, args.context_tokens)
               for i in range(args.samples_per_task) for task in TASKS]
    stats = {s.label: SpecStats() for s in specs}
    per_task: dict[tuple[str, str], list[bool]] = {}
    n_tokens = []
    for smp in tqdm(samples, desc="fidelity", unit="sample", disable=args.no_progress):
        n_tokens.append(len(turn_tokens(tok, smp, 0)))
        before = {k: len(v.correct) for k, v in stats.items()}
        run_sample(model, tok, smp, specs, chunk=args.chunk_size, max_new=args.max_new, method=args.method,
                   window=args.window, stats=stats)
        for k, v in stats.items():
            per_task.setdefault((k, smp.task), []).extend(v.correct[before[k]:])
    t_modes = time.time() - t_start
    # box plots: per-head retention of the method at rho=0.5 on more held-out samples, per task
    rho_box = 0.5 if 0.5 in profiles else rhos[0]
    ret = {}
    for task in TASKS:
        box = build_corpus(args.box_samples_per_task, "heldout", context_tokens=args.context_tokens, tasks=(task,))
        ret[task] = retention_samples(model, tok, box, args.method, [rho_box], chunk=args.chunk_size,
                                      window=args.window, progress=not args.no_progress)[rho_box]
    flat, layer = _spearman_tables(ret)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_boxes(ret, profiles[rho_box], [l for l in box_layers if l < L], out / "retention_boxes.png")
    rows = []
    for s in specs:
        st = stats[s.label]
        rows.append({"label": s.label, "mode": s.label.split("@")[0], "rho": s.rho,
                     "agreement": float(np.mean(st.agree)), "mass": float(np.mean(st.mass)),
                     "accuracy": float(np.mean(st.correct)),
                     "overflow": float(np.mean(st.overflow)) if st.overflow else None,
                     "kept": float(np.mean(st.kept)) if st.kept else None,
                     "mean_B": float(np.mean(s.budgets)) if s.budgets is not None else None})
    plot_agreement(rows, out / "agreement.png")
    command = "python -m tangram.profiles.fidelity " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    meta = {"command": command, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "model": model.cfg.name, "weights": info["source"], "method": args.method, "profiles": {
                f"{r:g}": str(paths[r]) for r in rhos},
            "samples": len(samples), "turns": sum(len(s.turns) for s in samples), "prompt_tokens": n_tokens,
            "chunk_size": args.chunk_size, "max_new": args.max_new, "box_samples_per_task": args.box_samples_per_task,
            "seconds_modes": round(t_modes, 1), "seconds_total": round(time.time() - t_start, 1),
            "torch_threads": torch.get_num_threads()}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "spearman_flat": flat,
                                                  "spearman_within_layer": layer, "per_task": {
                                                      f"{k}|{t}": float(np.mean(v)) for (k, t), v in per_task.items()}},
                                                 indent=1))
    import glob
    shipped = []
    listed = args.list_profiles or str(registry.DATA_DIR / f"{cfg.name}_*.npz")
    for f in sorted(glob.glob(listed)):
        pr = BudgetProfile.load(f)
        shipped.append((Path(f).name, pr.method, pr.rho, pr.provenance.get("samples"), pr.n_samples,
                        float(pr.mu.mean()), float(pr.sigma.mean()), float(pr.B.mean()), float(pr.B.min()),
                        float(pr.B.max())))
    (out / "report.md").write_text(_markdown(meta, rows, per_task, flat, layer, specs, profiles, rho_box, shipped))
    print(f"wrote {out / 'report.md'} in {meta['seconds_total']:.0f} s")
    return 0


def _markdown(meta, rows, per_task, flat, layer, specs, profiles, rho_box, shipped) -> str:
    f = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
    lines = [
        "# Fidelity of the serving modes on SmolLM2-135M-Instruct (real weights, CPU)",
        "",
        f"Generated by `{meta['command']}` on {meta['date']} "
        f"({meta['seconds_total']:.0f} s on this 2-core CPU, torch threads = {meta['torch_threads']}).",
        "",
        f"Model `{meta['model']}` from `{Path(meta['weights']).name}` (Q4_1 GGUF dequantised to fp32). "
        f"Scoring method `{meta['method']}`; tangram budgets from the calibrated profiles "
        f"{', '.join('`' + p + '`' for p in meta['profiles'].values())} (50 `calib`-split samples, alpha = "
        f"{next(iter(profiles.values())).alpha:g}). Evaluation on the disjoint `heldout` split: "
        f"{meta['samples']} samples ({meta['samples'] // len(TASKS)} per task), {meta['turns']} question turns, "
        f"first-turn prompts of {min(meta['prompt_tokens'])}-{max(meta['prompt_tokens'])} tokens, "
        f"chunk size C = {meta['chunk_size']}, answers up to {meta['max_new']} tokens. Sample counts are small "
        "because every mode re-runs the model on this CPU; treat differences of a few points as noise.",
        "",
        "Compression happens per prefill chunk: a head keeps its selected share of each chunk's new tokens "
        "(`uniform`: top-ceil(rho*C) per head; `dynamic`: Ada-SnapKV's layer-wide top-ceil(rho*H*C); "
        "`tangram-hp1`: top-ceil(B[l,h]*C) per head; `tangram-a0`: the same with alpha = 0, i.e. B = mu, a "
        "memory-matched control that keeps about rho like `dynamic`; `tangram-hp3`: every head gets its clustered "
        "group's largest budget, H_p = 3 = all KV heads of a layer). Decode tokens are kept. With alpha = 2, "
        "B = mu + 2 sigma keeps more than rho (column *kept share*), so `tangram-hp1`/`hp3` use more KV memory than "
        "`uniform`/`dynamic` at the same rho; compare them with care, and compare `tangram-a0` with `dynamic` for "
        "equal memory.",
        "",
        "| mode | rho | greedy agreement | attention mass | task accuracy | overflow rate | kept share | mean B |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['rho']:g} | {f(r['agreement'])} | {f(r['mass'])} | {f(r['accuracy'])} | "
                     f"{f(r['overflow'])} | {f(r['kept'])} | {f(r['mean_B'])} |")
    lines += ["", "Task accuracy per task (share of turns whose free greedy answer contains the known answer):", "",
              "| mode | " + " | ".join(TASKS) + " |", "|---|" + "---|" * len(TASKS)]
    for s in specs:
        lines.append(f"| {s.label} | " + " | ".join(f(float(np.mean(per_task[(s.label, t)])))
                                                     if per_task.get((s.label, t)) else "–" for t in TASKS) + " |")
    lines += [
        "", "Definitions: *greedy agreement* = share of `full`'s answer tokens that the mode also predicts as argmax "
        "when fed `full`'s previous tokens (teacher forcing; every mode shares `full`'s answers as history); "
        "*attention mass* = over those answer queries, all layers and query heads, the share of the uncompressed "
        "softmax mass on tokens the mode kept; *overflow rate* = share of (chunk >= 64 tokens, layer, head) where "
        "the dynamic method's count exceeds the static budget ceil(B*C); *kept share* = kept fraction of "
        "prefilled tokens per chunk.",
        "", "![agreement and attention mass vs rho](agreement.png)", "",
        f"## Per-head retention by task (paper Figure 5), rho = {rho_box:g}", "",
        f"{meta['box_samples_per_task']} held-out samples per task, the method's implicit per-head retention "
        "(layer-wide top-k per chunk on the full model); heads sorted by the calibrated budget; dashed lines are the "
        "reserved budgets B.", "", "![per-head retention boxes](retention_boxes.png)", "",
        "Rank stability across tasks (Spearman correlation of the per-head mean retention):", "",
        "| task A | task B | over all L x H heads | mean within-layer (H = 3 heads) |", "|---|---|---|---|"]
    for (a, b, x), (_, _, y) in zip(flat, layer):
        lines.append(f"| {a} | {b} | {x:.3f} | {y:.3f} |")
    if shipped:
        lines += ["", "## Shipped profiles (`tangram/profiles/`)", "",
                  "| file | method | rho | prompts | retention samples (chunks) | mean mu | mean sigma | mean B | min B | max B |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in shipped:
            lines.append(f"| {r[0]} | {r[1]} | {r[2]:g} | {r[3]} | {r[4]} | " + " | ".join(f"{x:.3f}" for x in r[5:]) + " |")
    lines += ["", "Raw numbers: `results.json` in this folder.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
