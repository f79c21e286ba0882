"""``tangram-profile``: run a compression method's scoring on a real model and write a BudgetProfile.

Example (SmolLM2 profiles of two methods)::

    tangram-profile --model smollm2-135m --weights auto --method ada-snapkv,keydiff --samples 50 \\
        --rho 0.75,0.5,0.25,0.1 --scope per-layer,cross-layer --alpha 2 --corpus scbench-synth --split calib \\
        -o 'tangram/profiles/data/smollm2-135m_{method}_{scope}_rho{rho}.npz'

``--method``, ``--rho`` and ``--scope`` take comma lists; then ``-o`` must
contain ``{method}`` / ``{rho}`` / ``{scope}``. One model forward per chunk
serves every method (the forward dominates on a CPU), and one scoring pass
every scope and ratio; each profile records the pass's shared forward time
and its scorer's own time.
"""
from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
from pathlib import Path

from tangram.errors import ConfigError, InputError
from tangram.cli import Parser, check_at_least, cli_main, output_file


def _methods(text: str) -> list[str]:
    from tangram.budgets import METHODS
    vals = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [v for v in vals if v not in METHODS]
    if not vals or bad:
        raise ConfigError(f"--method: unknown scoring method {(bad or [''])[0]!r}; choose from {', '.join(METHODS)}")
    return vals


def _scopes(text: str, methods: list[str]) -> dict[str, list[str]]:
    """{method: scopes}: every listed scope the method has (pyramidkv has no cross-layer scope: with several
    methods it is left out for pyramidkv and said so; alone it is an error)."""
    from tangram.budgets import SCOPES, check_method_scope
    vals = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not vals:
        raise ConfigError("--scope needs at least one of per-layer, cross-layer")
    for v in vals:
        if v == "uniform":
            raise ConfigError("--scope uniform needs no calibration: every head keeps its layer's target "
                              "(tangram.budgets.uniform_profile)")
        if v not in SCOPES:
            raise ConfigError(f"--scope: unknown budget scope {v!r}; choose from per-layer, cross-layer")
    out = {}
    for m in methods:
        ok = []
        for v in vals:
            try:
                check_method_scope(m, v)
                ok.append(v)
            except ConfigError:
                if len(methods) == 1 or len(vals) == 1:
                    raise
                print(f"note: {m} has no {v} scope; left out", file=sys.stderr)
        out[m] = ok
    return out


def _rhos(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--rho must be numbers separated by commas, got {text!r}") from None
    if not vals or any(not (0 < v <= 1) for v in vals):
        raise ConfigError(f"--rho values must be in (0, 1], got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    from tangram.profiles.corpus import CORPORA, SPLITS
    p = Parser(prog="tangram-profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="model preset (tangram.config.MODELS)")
    p.add_argument("--weights", default="auto", help="auto | random | PATH.gguf | HF safetensors directory")
    p.add_argument("--tokenizer", default=None, help="GGUF file whose vocabulary to use (default: the weights' GGUF, "
                   "else the packaged SmolLM2)")
    p.add_argument("--method", default="ada-snapkv",
                   help="scoring method(s), comma list (several share one model forward per chunk): "
                        "ada-snapkv, pyramidkv, keydiff, tova, streaming-llm, expected-attention, kvzip")
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--rho", default="0.5", help="target global retention ratio(s), e.g. 0.5 or 0.25,0.5,0.75")
    p.add_argument("--scope", default="per-layer",
                   help="budget scope(s) the retention is taken under: per-layer (Ada-KV: one threshold per layer) "
                        "and/or cross-layer (one threshold over all layers), e.g. per-layer,cross-layer")
    p.add_argument("--alpha", type=float, default=2.0, help="safety margin of eq. 5")
    p.add_argument("--corpus", default="scbench-synth", choices=CORPORA)
    p.add_argument("--split", default="calib", choices=list(SPLITS))
    p.add_argument("--context-tokens", type=int, default=1024, help="approximate context length per sample")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk C; each chunk is scored on its own")
    p.add_argument("--unit", default="chunk", choices=("chunk", "sample"),
                   help="retention sample unit: per full prefill chunk (engine budgets are per chunk) or per prompt")
    p.add_argument("--window", type=int, default=None,
                   help="SnapKV/PyramidKV observation window (default 32; tangram.kernels.scoring.ScoreParams)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("-o", "--output", required=True,
                   help="profile path (.npz or .json); {rho}, {scope} and {method} are substituted")
    return p


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rhos = _rhos(args.rho)
    methods = _methods(args.method)
    scopes = _scopes(args.scope, methods)
    if len(rhos) > 1 and "{rho}" not in args.output:
        raise ConfigError("several --rho values need an output pattern containing {rho}")
    if max(len(v) for v in scopes.values()) > 1 and "{scope}" not in args.output:
        raise ConfigError("several --scope values need an output pattern containing {scope}")
    if len(methods) > 1 and "{method}" not in args.output:
        raise ConfigError("several --method values need an output pattern containing {method}")
    check_at_least(("--samples", args.samples, 1), ("--context-tokens", args.context_tokens, 16),
                   ("--chunk-size", args.chunk_size, 2), ("--threads", 1 if args.threads is None else args.threads, 1))
    if not args.alpha >= 0 or args.alpha == float("inf"):  # NaN fails both comparisons
        raise ConfigError(f"--alpha must be a finite margin >= 0, got {args.alpha}")
    if args.window is not None and args.window < 1:
        raise ConfigError(f"--window must be >= 1, got {args.window}")

    def out_path(method: str, scope: str, rho: float) -> str:
        return args.output.replace("{rho}", f"{rho:g}").replace("{scope}", scope).replace("{method}", method)

    for m, scs in scopes.items():
        for sc in scs:
            for r in rhos:
                out = Path(out_path(m, sc, r))
                if out.suffix not in (".npz", ".json"):
                    raise InputError(str(out), None, "-o", "profile file must end in .npz or .json")
                output_file(out, "-o")  # before the pass over the model (minutes): its result must be writable
    import dataclasses
    import time

    import torch

    from tangram.kernels.scoring import ScoreParams
    from tangram.profiles.retention import retention_multi
    from tangram.profiles.corpus import build_corpus
    from tangram.tokenizer import load_tokenizer
    from tangram.engine.weights import load_model
    if args.threads:
        torch.set_num_threads(args.threads)
    model, info = load_model(args.model, args.weights)
    tok = load_tokenizer(args.tokenizer or info.get("gguf_path"))
    if tok.vocab_size > model.cfg.vocab:
        raise ConfigError(f"tokenizer has {tok.vocab_size} tokens but model {model.cfg.name} only {model.cfg.vocab}")
    samples = build_corpus(args.samples, args.split, corpus=args.corpus, context_tokens=args.context_tokens)
    t0 = time.perf_counter()
    r, secs = retention_multi(model, tok, samples, scopes, rhos, chunk=args.chunk_size, window=args.window,
                              progress=not args.no_progress, unit=args.unit)
    seconds = time.perf_counter() - t0
    params = dataclasses.asdict(ScoreParams(**({"window": args.window} if args.window else {})))
    from tangram.budgets import calibrate
    prog = Path(sys.argv[0]).name if Path(sys.argv[0]).name in ("tangram-profile", "tangram-calibrate") else "python -m tangram.profiles.cli"
    command = prog + " " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    for (method, scope, rho), x in r.items():
        prov = {"model": model.cfg.name, "method": method, "scope": scope, "rho": rho, "samples": args.samples,
                "corpus": args.corpus, "split": args.split, "command": command, "date": date,
                "weights": info["source"], "synthetic": bool(info.get("synthetic", False)),
                "chunk_size": args.chunk_size, "unit": args.unit, "retention_samples": int(x.shape[0]),
                "context_tokens": args.context_tokens, "score_params": params,
                # seconds of the pass (wall; _cpu: process CPU): the shared model forward, this method's scorer
                "forward_seconds": round(secs["forward"], 2), "scorer_seconds": round(secs[method], 3),
                "forward_cpu_seconds": round(secs["forward:cpu"], 2),
                "scorer_cpu_seconds": round(secs[f"{method}:cpu"], 3),
                "pass_seconds": round(seconds, 1), "pass_methods": methods,
                "torch_threads": torch.get_num_threads(),
                "tasks": sorted({s.task for s in samples}), "torch": torch.__version__}
        prof = calibrate(x, args.alpha, rho=rho, method=method, model=model.cfg.name, provenance=prov,
                         scope=scope)
        out = prof.save(out_path(method, scope, rho))
        B = prof.B
        lm = prof.mu.mean(axis=1)
        print(f"{out}: {prof.shape[0]}x{prof.shape[1]} heads, {method} {scope} rho={rho:g} alpha={args.alpha:g} "
              f"mean B={B.mean():.3f} (min {B.min():.3f}, max {B.max():.3f}), mean sigma={prof.sigma.mean():.3f}, "
              f"layer means of mu {lm.min():.3f}..{lm.max():.3f}")
    print(f"pass: {seconds:.1f} s for {args.samples} samples (torch threads {torch.get_num_threads()}): model forward "
          f"{secs['forward']:.1f} s; scorers " + ", ".join(f"{m} {secs[m]:.1f} s" for m in methods)
          + f"; CPU seconds: forward {secs['forward:cpu']:.1f}, "
          + ", ".join(f"{m} {secs[m + ':cpu']:.1f}" for m in methods))
    return 0


if __name__ == "__main__":
    main()
