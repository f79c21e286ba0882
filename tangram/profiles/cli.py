"""``tangram-profile``: run a compression method's scoring on a real model and write a BudgetProfile.

Example (the shipped SmolLM2 profile)::

    tangram-profile --model smollm2-135m --weights auto --method ada-snapkv --samples 50 \\
        --rho 0.5 --alpha 2 --corpus scbench-synth --split calib -o profile.npz

``--rho`` takes a comma list; then ``-o`` must contain ``{rho}`` and one
scoring pass writes one profile per ratio.
"""
from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
from pathlib import Path

from tangram.errors import ConfigError, InputError, cli_errors


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
    from tangram.profiles.scoring import METHODS
    p = argparse.ArgumentParser(prog="tangram-profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="model preset (tangram.config.MODELS)")
    p.add_argument("--weights", default="auto", help="auto | random | PATH.gguf | HF safetensors directory")
    p.add_argument("--tokenizer", default=None, help="GGUF file whose vocabulary to use (default: the weights' GGUF, "
                   "else the packaged SmolLM2)")
    p.add_argument("--method", default="ada-snapkv", choices=METHODS)
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--rho", default="0.5", help="target global retention ratio(s), e.g. 0.5 or 0.25,0.5,0.75")
    p.add_argument("--alpha", type=float, default=2.0, help="safety margin of eq. 5")
    p.add_argument("--corpus", default="scbench-synth", choices=CORPORA)
    p.add_argument("--split", default="calib", choices=list(SPLITS))
    p.add_argument("--context-tokens", type=int, default=1024, help="approximate context length per sample")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk C; each chunk is scored on its own")
    p.add_argument("--unit", default="chunk", choices=("chunk", "sample"),
                   help="retention sample unit: per full prefill chunk (engine budgets are per chunk) or per prompt")
    p.add_argument("--window", type=int, default=None, help="observation window (default 32 SnapKV, 64 EA)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("-o", "--output", required=True, help="profile path (.npz or .json); {rho} is substituted")
    return p


@cli_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rhos = _rhos(args.rho)
    if len(rhos) > 1 and "{rho}" not in args.output:
        raise ConfigError("several --rho values need an output pattern containing {rho}")
    if args.samples < 1 or args.context_tokens < 16 or args.chunk_size < 2:
        raise ConfigError("--samples >= 1, --context-tokens >= 16 and --chunk-size >= 2 are required")
    if args.alpha < 0:
        raise ConfigError(f"--alpha must be >= 0, got {args.alpha}")
    for r in rhos:
        out = Path(args.output.replace("{rho}", f"{r:g}"))
        if out.suffix not in (".npz", ".json"):
            raise InputError(str(out), None, "-o", "profile file must end in .npz or .json")
    import torch

    from tangram.profiles.retention import retention_samples
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
    r = retention_samples(model, tok, samples, args.method, rhos, chunk=args.chunk_size, window=args.window,
                          progress=not args.no_progress, unit=args.unit)
    from tangram.budgets import calibrate
    prog = Path(sys.argv[0]).name if Path(sys.argv[0]).name in ("tangram-profile", "tangram-calibrate") else "python -m tangram.profiles.cli"
    command = prog + " " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    for rho in rhos:
        prov = {"model": model.cfg.name, "method": args.method, "samples": args.samples, "corpus": args.corpus,
                "split": args.split, "command": command, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "weights": info["source"], "synthetic": bool(info.get("synthetic", False)),
                "chunk_size": args.chunk_size, "unit": args.unit, "retention_samples": int(r[rho].shape[0]),
                "context_tokens": args.context_tokens,
                "window": args.window, "tasks": sorted({s.task for s in samples}), "torch": torch.__version__}
        prof = calibrate(r[rho], args.alpha, rho=rho, method=args.method, model=model.cfg.name, provenance=prov)
        out = prof.save(args.output.replace("{rho}", f"{rho:g}"))
        B = prof.B
        print(f"{out}: {prof.shape[0]}x{prof.shape[1]} heads, rho={rho:g} alpha={args.alpha:g} "
              f"mean B={B.mean():.3f} (min {B.min():.3f}, max {B.max():.3f}), mean sigma={prof.sigma.mean():.3f}")
    return 0


if __name__ == "__main__":
    main()
