"""Budget-aware placement of KV heads on tensor-parallel ranks (issue 16.2).

Tensor parallelism shards attention by KV head: rank ``r`` of ``N`` holds ``H/N`` KV heads of every layer with
their ``gqa`` query heads (a KV head never leaves its query heads), and computes their attention alone. Megatron
and vLLM shard contiguously (rank ``r`` holds heads ``r*H/N .. (r+1)*H/N - 1``). With non-uniform budgets that
split is blind to where the retained tokens are: a layer whose retrieval heads sit together puts most of its KV
pages and decode reads on one rank, and since every layer ends in an all-reduce, that rank sets the step time and
runs out of pages first. Heads can be placed anywhere at load time (the shards of a layer's q/k/v and o weights
are permuted together), so we pick, per layer, an assignment of ``H/N`` heads to each rank that balances the
calibrated budgets:

* ``contiguous``: the Megatron split, the baseline.
* ``balanced``: heads sorted by budget dealt in snake order (0..N-1, N-1..0, ...), then pairwise swaps between the
  heaviest and the lightest rank while one lowers the heaviest (Karmarkar-Karp style local search), and per layer
  the better of that and the contiguous split, so it is never worse than contiguous on any layer's heaviest rank.
  Rank labels are then permuted per layer (heaviest layer first, heaviest rank to the lightest running total), so
  the per-rank totals over layers (the KV pages each GPU holds) balance as well as the per-layer loads (decode).

A placement is an ``order[L, H]``: rank ``r`` holds KV heads ``order[l, r*H/N:(r+1)*H/N]`` of layer ``l``.
:func:`slot_perm` turns it into the ``KVLayout`` slot order (rank-major; each rank's heads budget-sorted when
clustering is on), so every table and head group lies on one rank and rank ``r`` owns slots
``r*H/N .. (r+1)*H/N - 1``. Load-time work on ``[L, H]`` arrays (numpy over layers; the local search loops over at
most ``H`` swap rounds, not over heads).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from tangram.cli import cli_main
from tangram.config import PLACEMENTS
from tangram.errors import ConfigError


def check_tp(num_kv_heads: int, tp: int, heads_per_group: int | None = None) -> int:
    """KV heads per rank; a clear error when the shape cannot be sharded (equal heads per rank, whole groups)."""
    if tp < 1:
        raise ConfigError(f"tensor-parallel degree must be >= 1, got {tp}")
    if num_kv_heads % tp:
        raise ConfigError(f"tp={tp} must divide the {num_kv_heads} KV heads (equal KV heads per rank; "
                          f"valid: {', '.join(str(d) for d in range(1, num_kv_heads + 1) if num_kv_heads % d == 0)})")
    hr = num_kv_heads // tp
    if heads_per_group is not None and hr % heads_per_group:
        raise ConfigError(f"heads per group H_p={heads_per_group} must divide the {hr} KV heads of a rank at tp={tp} "
                          f"(a head group lives on one rank)")
    return hr


def snake_ranks(n: int, tp: int) -> np.ndarray:
    """Rank of the i-th heaviest head in snake order: 0, 1, .., N-1, N-1, .., 0, 0, 1, .. (equal counts)."""
    i = np.arange(n)
    r = i % tp
    return np.where((i // tp) % 2 == 0, r, tp - 1 - r)


def _order_from_ranks(ranks: np.ndarray, tp: int) -> np.ndarray:
    """``order[L, H]`` (rank-major, heads ascending inside a rank) from each head's rank ``ranks[L, H]``."""
    key = ranks * ranks.shape[1] + np.arange(ranks.shape[1])[None]
    return np.argsort(key, axis=1, kind="stable")


def rank_loads(B: np.ndarray, order: np.ndarray, tp: int) -> np.ndarray:
    """Sum of the weights ``B[L, H]`` of each rank's heads: ``[L, N]``."""
    Bo = np.take_along_axis(np.asarray(B, dtype=np.float64), order, axis=1)
    L, H = Bo.shape
    return Bo.reshape(L, tp, H // tp).sum(axis=2)


def _swap_refine(B: np.ndarray, ranks: np.ndarray, tp: int, max_rounds: int | None = None) -> np.ndarray:
    """Swap one head of the heaviest rank with one of the lightest while that lowers the heaviest, per layer
    (all layers at once; a layer stops when no swap helps)."""
    L, H = B.shape
    hr = H // tp
    ranks = ranks.copy()
    rows = np.arange(L)
    for _ in range(max_rounds or 4 * H):
        order = _order_from_ranks(ranks, tp)
        loads = rank_loads(B, order, tp)
        rmax, rmin = loads.argmax(axis=1), loads.argmin(axis=1)
        gap = loads[rows, rmax] - loads[rows, rmin]
        o3 = order.reshape(L, tp, hr)
        hi = o3[rows, rmax]  # [L, hr] heads of the heaviest rank
        lo = o3[rows, rmin]
        d = np.take_along_axis(B, hi, axis=1)[:, :, None] - np.take_along_axis(B, lo, axis=1)[:, None, :]
        # moving d from the heaviest to the lightest helps iff 0 < d < gap; best when d is closest to gap / 2
        ok = (d > 1e-12) & (d < gap[:, None, None] - 1e-12)
        score = np.where(ok, np.abs(d - gap[:, None, None] / 2), np.inf).reshape(L, -1)
        best = score.argmin(axis=1)
        act = np.isfinite(score[rows, best])
        if not act.any():
            break
        a = hi[rows, best // hr][act]
        b = lo[rows, best % hr][act]
        la = rows[act]
        ra, rb = ranks[la, a].copy(), ranks[la, b].copy()
        ranks[la, a], ranks[la, b] = rb, ra
    return ranks


def _balanced_ranks(W: np.ndarray, tp: int) -> np.ndarray:
    """Rank of each item ``[L, n]`` (``n/N`` items per rank) balancing the summed weights ``W[L, n]`` per layer:
    snake deal of the items by decreasing weight, then :func:`_swap_refine`."""
    L, n = W.shape
    heavy_first = np.argsort(-W, axis=1, kind="stable")
    ranks = np.empty((L, n), dtype=np.int64)
    np.put_along_axis(ranks, heavy_first, np.broadcast_to(snake_ranks(n, tp), (L, n)), axis=1)
    return _swap_refine(W, ranks, tp)


def head_placement(B: np.ndarray, tp: int, placement: str = "balanced", heads_per_group: int = 1,
                   clustered: bool = True) -> np.ndarray:
    """``order[L, H]``: rank ``r`` holds KV heads ``order[l, r*H/N:(r+1)*H/N]`` of layer ``l``.

    ``B`` is what to balance per head (the calibrated budget ratios: the pages a head reserves and the tokens its
    decode reads are both proportional to it at a given context). ``balanced`` first forms the layer's head
    groups as one GPU would (``H_p`` budget-sorted heads each when ``clustered``, else ``H_p`` adjacent heads),
    then deals whole groups to ranks: a group's pages are sized by its largest head, so splitting a
    budget-clustered group across ranks would add pages; with ``H_p = 1`` groups are single heads."""
    B = np.asarray(B, dtype=np.float64)
    if B.ndim != 2:
        raise ConfigError(f"budgets must be [L, H], got shape {B.shape}")
    L, H = B.shape
    check_tp(H, tp, heads_per_group)
    contiguous = np.tile(np.arange(H), (L, 1))
    if placement not in PLACEMENTS:
        raise ConfigError(f"unknown head placement {placement!r}; choose from {', '.join(PLACEMENTS)}")
    if placement == "contiguous" or tp == 1:
        return contiguous
    hp = heads_per_group
    G = H // hp
    members = (np.argsort(B, axis=1, kind="stable") if clustered else contiguous).reshape(L, G, hp)
    W = np.take_along_axis(B, members.reshape(L, H), axis=1).reshape(L, G, hp).sum(axis=2)
    granks = _balanced_ranks(W, tp)  # [L, G]
    gorder = _order_from_ranks(granks, tp)  # groups rank-major
    bal = np.take_along_axis(members, gorder[:, :, None], axis=1).reshape(L, H)
    worse = rank_loads(B, bal, tp).max(axis=1) > rank_loads(B, contiguous, tp).max(axis=1) + 1e-12
    bal[worse] = contiguous[worse]
    return _relabel(B, bal, tp)


def _relabel(B: np.ndarray, order: np.ndarray, tp: int) -> np.ndarray:
    """Permute rank labels per layer so per-rank totals over layers balance (LPT over the layers' bins): layers
    in decreasing spread, each layer's heaviest bin to the rank with the lightest running total."""
    L, H = order.shape
    hr = H // tp
    loads = rank_loads(B, order, tp)
    o3 = order.reshape(L, tp, hr)
    out = np.empty_like(o3)
    total = np.zeros(tp)
    for l in np.argsort(-(loads.max(axis=1) - loads.min(axis=1)), kind="stable"):  # one pass over layers
        bins = np.argsort(-loads[l], kind="stable")
        dest = np.argsort(total, kind="stable")
        out[l, dest] = o3[l, bins]
        total[dest] += loads[l, bins]
    return out.reshape(L, H)


def slot_perm(B: np.ndarray, tp: int, heads_per_group: int, clustered: bool = True,
              placement: str = "balanced") -> np.ndarray:
    """KVLayout slot order ``perm[L, H]`` under tensor parallelism: rank-major (rank ``r`` owns slots
    ``r*H/N..``), each rank's heads budget-sorted when ``clustered`` (then grouped ``H_p`` at a time, as
    :func:`tangram.budgets.head_groups` does for one GPU) or in head order."""
    B = np.asarray(B, dtype=np.float64)
    L, H = B.shape
    hr = check_tp(H, tp, heads_per_group)
    order = head_placement(B, tp, placement, heads_per_group, clustered)
    if clustered:
        o3 = order.reshape(L, tp, hr)
        b3 = np.take_along_axis(B, order, axis=1).reshape(L, tp, hr)
        order = np.take_along_axis(o3, np.argsort(b3, axis=2, kind="stable"), axis=2).reshape(L, H)
    else:
        order = np.sort(order.reshape(L, tp, hr), axis=2).reshape(L, H)
    return order


def rank_of_slots(num_kv_heads: int, tp: int) -> np.ndarray:
    """Rank owning each slot: slots are rank-major."""
    return np.repeat(np.arange(tp), num_kv_heads // tp)


def rank_tables(n_layers: int, n_groups: int, tp: int) -> np.ndarray:
    """Rank owning each ragged table ``t = l*G + g`` (groups are rank-major inside a layer)."""
    return np.tile(np.repeat(np.arange(tp), n_groups // tp), n_layers)


def page_shares(B: np.ndarray, perm: np.ndarray, tp: int, heads_per_group: int, ragged: bool) -> np.ndarray:
    """Share of a long request's pages each rank holds ``[N]`` (sums to 1): a ragged table is sized by its
    largest head, so the share of rank ``r`` is its groups' summed largest budgets. Monolithic pages span every
    head of every rank (each rank holds its ``1/N`` of every page): equal shares."""
    if not ragged or tp == 1:
        return np.full(tp, 1.0 / tp)
    Bs = np.take_along_axis(np.asarray(B, dtype=np.float64), perm, axis=1)
    L, H = Bs.shape
    gmax = Bs.reshape(L, tp, H // tp // heads_per_group, heads_per_group).max(axis=3).sum(axis=(0, 2))
    return gmax / gmax.sum()


def imbalance(B: np.ndarray, perm: np.ndarray, tp: int, heads_per_group: int, *, context: int, page_size: int,
              ragged: bool = True) -> dict:
    """Per-rank reserved pages and decode reads of one request of ``context`` tokens (Budget Reservation: head
    ``h`` keeps ``ceil(B * context)`` tokens) under the slot order ``perm``.

    * pages: each ragged table of ``H_p`` heads holds ``ceil(longest head / P)`` pages; ``pages_max_over_mean`` is
      the fullest rank over the mean (it runs out of KV memory first).
    * decode: per layer, the KV bytes each rank reads (its heads' kept tokens; the decode kernel reads each head's
      own length); layers end in an all-reduce, so a step lasts ``sum_l max_r``; ``decode_max_over_mean`` is that
      over ``sum_l mean_r`` (1 = no rank ever waits)."""
    B = np.asarray(B, dtype=np.float64)
    L, H = B.shape
    hr = check_tp(H, tp, heads_per_group if ragged else None)
    kept = np.minimum(context, np.ceil(np.take_along_axis(B, perm, axis=1) * context - 1e-9)).astype(np.int64)
    k3 = kept.reshape(L, tp, hr)
    reads = k3.sum(axis=2).astype(np.float64)  # [L, N] head-tokens read per layer and rank
    if ragged:
        g = k3.reshape(L, tp, hr // heads_per_group, heads_per_group).max(axis=3)
        pages = (-(-g // page_size)).sum(axis=(0, 2))  # a page holds H_p heads x P tokens of one layer
    else:  # one page spans all heads: every rank holds the same pages
        pages = np.full(tp, float(-(-kept.max() // page_size)))
    return {"pages_per_rank": pages.astype(np.int64), "pages_max_over_mean": float(pages.max() / pages.mean()),
            "reads_per_rank": reads.sum(axis=0).astype(np.int64),
            "decode_max_over_mean": float(reads.max(axis=1).sum() / reads.mean(axis=1).sum())}


def imbalance_table(B: np.ndarray, tp: int, heads_per_group: int, *, context: int, page_size: int = 16,
                    clustered: bool = True, placements=PLACEMENTS) -> pd.DataFrame:
    """One row per placement: per-rank head-pages and reads, and their max/mean (see :func:`imbalance`)."""
    rows = []
    for p in placements:
        perm = slot_perm(B, tp, heads_per_group, clustered, p)
        r = imbalance(B, perm, tp, heads_per_group, context=context, page_size=page_size)
        rows.append({"placement": p, "tp": tp, "hp": heads_per_group,
                     "pages_per_rank": " ".join(str(int(x)) for x in r["pages_per_rank"]),
                     "pages_max/mean": r["pages_max_over_mean"],
                     "decode_reads_per_rank": " ".join(str(int(x)) for x in r["reads_per_rank"]),
                     "decode_max/mean": r["decode_max_over_mean"]})
    return pd.DataFrame(rows)


def _parser():
    from tangram.cli import add_sweep, spec_parser
    from tangram.spec import OPTIONS

    # the deployment's options that shape a placement (flags generated from the option fields); the TP degrees
    # compared are the tool's own sweep of EngineConfig.tp
    p = spec_parser("tangram-placement", "Per-rank KV pages and decode reads of contiguous vs budget-balanced KV-head "
                    "placement under tensor parallelism.",
                    ("model", "profile", "seed", "rho", "alpha", "page_size", "heads_per_group", "clustering"),
                    config=False, show={"heads_per_group": "all KV heads of a rank, per TP degree",
                                        "alpha": f"the profile's own; a synthetic one's {OPTIONS['alpha'].default}"})
    add_sweep(p, "tp", "tensor-parallel degrees compared", default=[2])
    p.add_argument("--context", type=int, default=32768, help="tokens of the request whose KV is placed (default "
                                                                "32768)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    return p


@cli_main
def main(argv: list[str] | None = None) -> int:
    """``tangram-placement``: the imbalance table of contiguous vs balanced head placement for a model/profile."""
    import json

    from tangram.cli import from_cli, parse, spec_overrides

    a = parse(_parser(), argv)
    given = spec_overrides(a)
    # H_p left out: each TP degree groups all KV heads of a rank (the spec is built with a placeholder H_p of 1)
    spec = from_cli(a, **({} if "heads_per_group" in given else {"heads_per_group": 1}))
    model, eng, prof = spec.model, spec.engine, spec.profile
    if "alpha" in given:  # a profile file keeps its own margin unless one is given
        prof = prof.with_alpha(eng.alpha)
    if a.context <= 0:
        raise ConfigError(f"--context must be positive, got {a.context}")
    tps = list(a.tp)
    if not any(x == "--tp" or x.startswith("--tp=") for x in getattr(a, "_argv", [])) and \
            any(model.num_kv_heads % t for t in tps):  # the default degree (2) does not split this model's KV heads
        tps = [next((d for d in range(2, model.num_kv_heads + 1) if model.num_kv_heads % d == 0), 1)]  # SmolLM2: 3
    frames = []
    for tp in tps:
        hp = given.get("heads_per_group") or model.num_kv_heads // max(tp, 1)
        check_tp(model.num_kv_heads, tp, hp)
        frames.append(imbalance_table(prof.B, tp, hp, context=a.context, page_size=eng.page_size,
                                      clustered=eng.clustering))
    df = pd.concat(frames, ignore_index=True)
    if a.json:
        print(json.dumps({"model": model.name, "profile": spec.profile_label, "alpha": prof.alpha,
                          "context": a.context, "rows": df.to_dict(orient="records")}))
    else:
        print(f"{model.name}, one request of {a.context} tokens, alpha={prof.alpha:g}, P={eng.page_size}, "
              f"profile: {spec.profile_label}")
        print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    return 0


__all__ = ["PLACEMENTS", "check_tp", "head_placement", "slot_perm", "rank_loads", "rank_of_slots", "rank_tables",
           "page_shares", "imbalance", "imbalance_table", "snake_ranks"]


if __name__ == "__main__":
    main()
