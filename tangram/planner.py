"""Decode work partitioning: the AOT split map (Algorithm 1) and the two baselines.

* :func:`aot_split_map` runs once, offline, from budget ratios. The decode
  kernel reads ``S[l, g]`` and does no planning at run time.
* :func:`flashdecoding_num_splits` is FlashDecoding's static heuristic: one
  ``num_splits`` for every head, chosen from the batch shape alone.
* :func:`runtime_plan` is the FlashInfer-style per-layer plan a system must
  recompute every step when lengths differ across layers; it reports how much
  host work it did so that work can be priced.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from tangram.budgets import check_group_size, group_sums
from tangram.errors import ConfigError


def aot_split_map(B: np.ndarray, perm: np.ndarray, heads_per_group: int, n_cta: int,
                  rounding: str = "round") -> np.ndarray:
    """Algorithm 1: S[l, i] = max(1, R(Phi[l, i] / tau_l)), tau_l = Omega_l / N_CTA.

    ``rounding="round"`` is the paper's rule, implemented as round-half-up
    (``floor(x + 0.5)``, not numpy's round-half-to-even) so a share of exactly
    k + 1/2 CTAs always gets k + 1. ``rounding="ceil"`` is the primer's variant,
    which never gives a group fewer CTAs than its share (more CTAs in total).
    Layers whose budget sums to zero keep S = 1 (line 4).
    """
    if n_cta < 1:
        raise ConfigError(f"N_CTA must be >= 1, got {n_cta}")
    B = np.asarray(B, dtype=np.float64)
    check_group_size(B.shape[1], heads_per_group)
    phi = group_sums(B, perm, heads_per_group)  # [L, G]
    omega = B.sum(axis=1, keepdims=True)  # [L, 1]
    safe = np.where(omega > 0, omega, 1.0)
    share = phi / (safe / n_cta)
    if rounding == "round":
        s = np.floor(share + 0.5)
    elif rounding == "ceil":
        s = np.ceil(share - 1e-12)
    else:
        raise ConfigError(f"rounding must be 'round' or 'ceil', got {rounding!r}")
    s = np.where(omega > 0, s, 1.0)
    return np.maximum(1, s).astype(np.int32)


def pow2_bucket(n: int) -> int:
    """The power-of-two bucket of a size >= 1 (batch or context): 1, 2, 4, ... The AOT split table, the decode
    CUDA graphs and the cost model all key on it, so a step's bucket is the same everywhere."""
    return 1 << max(0, int(n) - 1).bit_length()


AOT_MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more (empty CTAs, a longer merge) than it balances
AOT_MAX_SPLITS = 128
# orders of an AOT decode launch's work items (tangram.engine.split_table.AotSplitTable, ExecutorOptions.decode_order):
# request-major; longest piece first; longest first with a bucket's exact launch balanced per SM in its first wave
DECODE_ORDERS = ("request", "lpt", "paired")
AOT_MAX_CONTEXT = 131072  # the largest context bucket of the split table (the bucket a lookup without one uses)


def aot_n_cta(n_occ: int, bucket: int, heads_per_group: int, waves: float = 1.0) -> int:
    """N_CTA handed to Algorithm 1 for one batch bucket.

    Algorithm 1 distributes N_CTA over the groups of a layer; the decode kernel launches
    ``S[l, g]`` CTAs for *each head* of group g and each request, i.e. about
    ``bucket * H_p * N_CTA`` CTAs. To fill the device's ``n_occ`` concurrent CTAs
    ``waves`` times, N_CTA = waves * n_occ / (bucket * H_p).
    """
    return max(1, int(round(waves * n_occ / (bucket * heads_per_group))))


MIN_CONTEXT_BUCKET = 1024


def decode_context_bucket(max_context: int) -> int:
    """The context bucket a decode step's longest logical context falls in: a power of two in [1024, 131072].
    The split table, the decode CUDA graphs and the cost model key on it."""
    return int(min(max(pow2_bucket(max(1, int(max_context))), MIN_CONTEXT_BUCKET), AOT_MAX_CONTEXT))


@dataclass(frozen=True)
class DecodeCosts:
    """What a decode launch costs, to choose its split map ahead of time (fitted on a GPU's decode table by
    ``tangram-fit-engine --decode-costs``; :meth:`default` otherwise).

    A launch of CTAs, each streaming its piece of one head, runs in waves of ``n_occ`` resident CTAs: the waves
    before the last stream at ``bw``; the last is a straggler tail where the CTAs still running share the
    bandwidth (processor sharing); every wave pays ``cta_s`` of fixed CTA latency (block-table and first-tile
    round trips, the partial's write). A launch costs ``launch_s``; splitting any head adds the merge kernel
    (``merge_s`` plus its partials' bytes).

    How ``a`` running CTAs share it (``rate_model``): ``"capped"``, each streams ``min(bw / a, cta_bw)``; or
    ``"saturating"``, together they stream ``bw * (1 - exp(-a * cta_bw / bw))`` (``cta_bw`` is then the slope
    at few CTAs). Measured on the H100 (2026-11-24 kernel sweep): 128 CTAs, one per SM, stream ~2.0-2.6 TB/s,
    not the ~2.9 TB/s that "capped" with a lone-CTA rate fitted on few-CTA rows gives, so "capped" priced the
    unsplit launches at batch 16 ~15% too fast and the routing kept them where a split ran 1.24-1.36x faster;
    "saturating" fits the Llama-3.1-8B rows to a median 2.4-3% (p90 8-12%) against 3.5-6% (9-15%)."""

    bw: float = 2.85e12
    cta_bw: float = 3.3e10  # one K and one V tile of 64 x 128 bf16 in flight per ~1 us round trip
    cta_s: float = 2.0e-6
    launch_s: float = 4.0e-6
    merge_s: float = 3.0e-6
    source: str = "default (not fitted)"
    # predicted gain a map needs over FlashDecoding's split to replace it: the fit's p90 relative error (a gain
    # inside the model's error is a coin toss; measured on the H100: 0.90-0.95x static at batch 1 / 8K when 5%)
    margin: float = 0.05
    rate_model: str = "capped"
    # the margin by batch bucket, where paired measurements gave one: ((smallest batch, margin), ...) ascending.
    # A map and FlashDecoding's split timed side by side on one point share most of the model's error (bandwidth,
    # latency), so the error of their predicted *ratio* is what a choice between them risks; its p90 per batch
    # (``tangram.sim.fit_decode --ratio-margins``, from benchmarks/aot_ceiling.py) replaces ``margin`` there.
    ratio_margins: tuple = ()

    FILENAME = "decode_costs.json"
    OPTIONAL = ("source", "margin", "rate_model", "ratio_margins")
    RATE_MODELS = ("capped", "saturating")

    def __post_init__(self):
        if self.rate_model not in self.RATE_MODELS:
            raise ConfigError(f"decode costs: rate_model must be one of {self.RATE_MODELS}, got {self.rate_model!r}")
        rm = tuple((int(b), float(m)) for b, m in self.ratio_margins)
        if any(b < 1 or not 0.0 <= m < 1.0 for b, m in rm) or [b for b, _ in rm] != sorted({b for b, _ in rm}):
            raise ConfigError(f"decode costs: ratio_margins must be ascending (batch >= 1, margin in [0, 1)) pairs, "
                              f"got {self.ratio_margins!r}")
        object.__setattr__(self, "ratio_margins", rm)

    def margin_for(self, batch: int) -> float:
        """The predicted gain a map needs over FlashDecoding's split at this batch bucket: the paired-ratio margin
        of the largest measured batch <= it (none below the smallest: ``margin``)."""
        m = self.margin
        for b, r in self.ratio_margins:
            if b <= batch:
                m = r
        return m

    def tail_seconds_per_byte(self, n: int) -> np.ndarray:
        """Seconds per byte of the j-th smallest CTA of a last wave of ``n`` (``n - j`` CTAs still running)."""
        return _tail_rates(int(n), float(self.bw), float(self.cta_bw), self.rate_model)

    @classmethod
    def default(cls, copy_bw: float | None = None) -> "DecodeCosts":
        if copy_bw:
            return cls(bw=0.94 * copy_bw, source="default, bw = 0.94 x measured copy bandwidth")
        return cls()

    @classmethod
    def load(cls, directory: str | Path | None, model: str | None = None) -> "DecodeCosts":
        """``decode_costs.json`` of a tables folder; else defaults (with its meta.json copy bandwidth, if any).

        ``model``: the costs fitted on that model's rows (the file's ``by_model`` entry) when the file has them,
        else the costs fitted on every row: a CTA of head_dim 64 streams at other rates than one of 128."""
        if directory is None:
            return cls.default()
        d = Path(directory)
        p = d / cls.FILENAME
        if p.exists():
            try:
                v = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p}:{e.lineno}: invalid JSON: {e.msg}") from None
            if not isinstance(v, dict):
                raise ConfigError(f"{p}: expected a JSON object")
            by_model = v.get("by_model") or {}
            if not isinstance(by_model, dict):
                raise ConfigError(f"{p}: by_model must be an object of model name -> costs")
            field = ""  # where the fields are read: the top level, or the model's own entry
            if model is not None and model in by_model:
                v, field = by_model[model], f"by_model.{model}."
                if not isinstance(v, dict):
                    raise ConfigError(f"{p}: {field[:-1]} must be an object")
            names = {f for f in cls.__dataclass_fields__ if f not in cls.OPTIONAL}
            missing = names - set(v)
            if missing:
                raise ConfigError(f"{p}: missing field(s) {sorted(missing)}" + (f" in {field[:-1]}" if field else ""))
            for k in sorted(names):
                x = v[k]
                if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
                    raise ConfigError(f"{p}: {field}{k} must be a positive number, got {x!r}")
            rm = v.get("rate_model", "capped")
            if rm not in cls.RATE_MODELS:
                raise ConfigError(f"{p}: {field}rate_model must be one of {list(cls.RATE_MODELS)}, got {rm!r}")
            rms = v.get("ratio_margins", [])
            if not isinstance(rms, list) or not all(isinstance(x, list) and len(x) == 2 for x in rms):
                raise ConfigError(f"{p}: {field}ratio_margins must be a list of [batch, margin] pairs")
            try:
                return cls(**{k: float(v[k]) for k in names}, margin=_fit_margin(v, p), rate_model=rm,
                           ratio_margins=tuple(tuple(x) for x in rms),
                           source=f"{p.name}{' ' + field[:-1] if field else ''}: {v.get('source', '')}".strip())
            except ConfigError as e:
                raise ConfigError(f"{p}: {field}{e}") from None
        copy = None
        if (d / "meta.json").exists():
            try:
                copy = float(json.loads((d / "meta.json").read_text()).get("copy_gbps") or 0) * 1e9 or None
            except (json.JSONDecodeError, TypeError, ValueError):
                copy = None
        return cls.default(copy)

    def to_json(self, path: str | Path, extra: dict | None = None) -> None:
        Path(path).write_text(json.dumps({**asdict(self), **(extra or {})}, indent=1) + "\n")

    def scaled(self, *, bandwidth: float = 1.0, cta_rate: float = 1.0, latency: float = 1.0,
               note: str = "") -> "DecodeCosts":
        """These costs on another machine: ``bw`` x ``bandwidth``, ``cta_bw`` x ``cta_rate``, the fixed latencies
        (``cta_s``, ``launch_s``, ``merge_s``) x ``latency``; the margin and rate model are kept. Factors of 1 are
        an exact identity."""
        for k, v in (("bandwidth", bandwidth), ("cta_rate", cta_rate), ("latency", latency)):
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"decode costs: {k} factor must be a positive number, got {v!r}")
        return replace(self, bw=self.bw * bandwidth, cta_bw=self.cta_bw * cta_rate, cta_s=self.cta_s * latency,
                       launch_s=self.launch_s * latency, merge_s=self.merge_s * latency,
                       source=f"{self.source}; {note}" if note else self.source)

    def transferred(self, bandwidth_ratio: float, label: str = "") -> "DecodeCosts":
        """Carried to another GPU model by its datasheet bandwidth ratio, by the rules of the table transfer
        (``tangram.sim.transfer``): the streaming bandwidth scales; the fixed latencies are latency floors, kept;
        a lone CTA's rate is bound by memory latency (the transfer keeps the straggler tails of the decode rows),
        kept. The ratio margins are not carried: they were measured on the source GPU's kernels, so the routing on
        the target keeps the fit's global margin until paired timings of its own give it margins."""
        return replace(self.scaled(bandwidth=bandwidth_ratio,
                                   note=f"bandwidth x{bandwidth_ratio:.4g}" + (f" ({label})" if label else "")),
                       ratio_margins=())

    @classmethod
    def for_gpu(cls, gpu_name: str, model: str | None = None, directory: str | Path | None = None) -> "DecodeCosts":
        """The costs the simulator prices ``gpu_name`` with when its tables are 'auto': the family folder's
        (:meth:`load`), or, for a GPU model without kernel tables of its own, those of the first family of
        :data:`TRANSFER_SOURCES` that has them carried over by :meth:`transferred` (datasheet bandwidth ratio), as
        ``tangram.sim.tables.resolve`` transfers the tables themselves. The engine routes with this, so it launches
        the maps the simulator prices (tests/test_decode_pricing.py checks the two agree). ``directory``: a pinned
        tables folder instead of the GPU's (``--tables DIR``), carried over the same way when it was measured on
        another GPU model (a folder written for this GPU by a transfer is read as it is)."""
        from tangram.config import get_gpu, gpu_for_device_name

        target = get_gpu(gpu_name)
        d = Path(directory) if directory is not None else kernel_tables_dir(gpu_name)
        if d is None:
            return cls.default()
        costs = cls.load(d, model)
        meta = {}
        if (d / "meta.json").exists():
            try:
                meta = json.loads((d / "meta.json").read_text())
            except json.JSONDecodeError:
                meta = {}
        src = None
        prov = meta.get("provenance") if isinstance(meta, dict) else None
        for st in reversed(prov if isinstance(prov, list) else []):
            if isinstance(st, dict) and st.get("kind") == "transfer":
                src = get_gpu(st["to"])
                break
        if src is None:
            src = gpu_for_device_name(meta.get("gpu_name") if isinstance(meta, dict) else None)
        if src is None or src.family == target.family:
            return costs
        return costs.transferred(target.mem_bandwidth / src.mem_bandwidth,
                                 f"transferred from {src.name} to {target.name} by datasheet")


def _fit_margin(v: dict, path: Path) -> float:
    """The routing margin of a decode_costs.json: its ``margin``, else the largest p90 relative error its ``fit``
    recorded per kernel, else the default."""
    if "margin" in v:
        m = v["margin"]
    else:
        p90 = [k.get("p90_abs_rel_err") for k in (v.get("fit") or {}).values() if isinstance(k, dict)]
        p90 = [x for x in p90 if isinstance(x, (int, float))]
        m = max(p90) if p90 else DecodeCosts.margin
    if not isinstance(m, (int, float)) or not 0.0 <= m < 1.0:
        raise ConfigError(f"{path}: margin must be a number in [0, 1), got {m!r}")
    return float(m)


# the kernel tables of a cost-table folder (``tangram.sim.tables``): a folder with none of them (e.g. only the
# all-reduce of a multi-GPU host) has its GPU priced by a transfer
TABLE_FILES = ("decode_attention.csv", "prefill_attention.csv", "gemm.csv", "elementwise.csv")
# families whose tables may be transferred to a GPU model without its own folder, in order of preference
TRANSFER_SOURCES = ("h100",)


def has_kernel_tables(d: Path) -> bool:
    """Whether a family folder holds kernel tables (else its GPU is priced by a transfer)."""
    return d.is_dir() and any((d / f).is_file() for f in TABLE_FILES)


def _tables_roots() -> tuple[Path, ...]:
    here = Path(__file__).resolve().parent
    return (here / "sim" / "tables", here.parent / "sim" / "tables")


def kernel_tables_dir(gpu_name: str) -> Path | None:
    """The folder whose kernel tables price ``gpu_name`` under 'auto' tables: its family's, or, for a GPU model
    without kernel tables of its own, the first of :data:`TRANSFER_SOURCES` that has them (then transferred by
    datasheet). One lookup for the simulator's ``resolve`` and the engine's routing costs."""
    d = tables_dir(gpu_name)
    if d is not None and has_kernel_tables(d):
        return d
    fam = gpu_name.lower().split("-")[0]
    return next((r / f for f in TRANSFER_SOURCES for r in _tables_roots() if f != fam and has_kernel_tables(r / f)),
                None)


def tables_dir(gpu_name: str) -> Path | None:
    """The cost-table folder of a GPU preset (``h100-80gb`` -> ``.../sim/tables/h100``), found by path so the
    engine reads the same data files as the simulator without importing it (repo or installed layout)."""
    fam = gpu_name.lower().split("-")[0]
    for root in _tables_roots():
        if (root / fam).is_dir():
            return root / fam
    return None


def wave_time(size_bytes: np.ndarray, reps: np.ndarray, n_occ: int, bw: float, cta_bw: float,
              cta_s: float = 0.0) -> np.ndarray:
    """Seconds per row (layer) of a launch whose CTAs come in launch order: ``reps[l, i]`` CTAs of
    ``size_bytes[l, i]`` bytes each. The CTAs before the last wave stream at full bandwidth (dynamic dispatch
    hides their imbalance); the last wave is a straggler tail priced as bandwidth shared by the CTAs still
    running, each capped at one CTA's rate (processor sharing over the tail's sorted sizes); each wave adds
    ``cta_s``. Shared by the AOT regime choice and the simulator's decode pricing.

    Only the tail (at most ``n_occ`` CTAs a row) is materialised: the body is the row's total bytes minus the
    tail's, so a step costs O(entries + L * n_occ), not O(CTAs) (the simulator prices ~10^5 decode launches).
    A caller pricing the same launch shape again and again keeps :func:`wave_launch` and calls
    :func:`launch_wave_time` (the same arithmetic, bit for bit)."""
    size_bytes = np.asarray(size_bytes, dtype=np.float64)
    L = size_bytes.shape[0]
    return launch_wave_time(size_bytes.reshape(L, -1), wave_launch(reps, n_occ), bw, cta_bw, cta_s)


@dataclass(frozen=True, eq=False)
class WaveLaunch:
    """What :func:`wave_time` derives from the CTA counts alone (integers: the same for every pricing of one
    launch shape, whatever the sizes): per entry its CTAs, the waves per row, and where each CTA of the last wave
    comes from (flat index into the sizes) and goes (into the tail)."""

    reps: np.ndarray  # float64 [L, n] CTAs per entry (exact integers)
    waves: np.ndarray  # int64 [L]
    src: np.ndarray  # intp [m] flat index into size_bytes of each tail CTA
    dst: np.ndarray  # intp [m] flat index into the [L, w] block of the tail that is sorted
    n_occ: int
    width: int  # w: the longest last wave (the columns of the tail that can be non-zero)
    empty: bool  # no CTA at all
    ctas: np.ndarray  # float64 [L] CTAs per row (the partials a split launch writes and its merge reads)
    split: np.ndarray  # bool [L] some entry of the row is cut into more than one CTA (the merge kernel runs)
    # How a pricing reads the last wave (tail_wave_time): CTA by CTA (tsrc, tdst = src, dst), or, when the tail's
    # CTAs are at least 8 times its entries (heads split into many equal pieces), entry by entry: an entry's CTAs are
    # equal, so the tail sorts its entries and each counts its CTAs (tcnt) from its first position on
    grouped: bool = False
    tsrc: np.ndarray | None = None  # intp flat index into size_bytes of each tail CTA (each tail entry: grouped)
    tdst: np.ndarray | None = None  # intp flat index into the [L, twidth] block of the tail that is sorted
    twidth: int = 0
    tcnt: np.ndarray | None = None  # float64 [L, twidth] CTAs of each tail entry (grouped)
    first: np.ndarray | None = None  # intp [L] position of a row's first tail CTA among the n_occ (N - tail CTAs)


def wave_launch(reps: np.ndarray, n_occ: int) -> WaveLaunch:
    """The integer structure of a launch of ``reps[l, i]`` CTAs per entry over ``n_occ`` resident CTAs (read-only
    arrays: a caller may keep it for every launch of this shape)."""
    reps = np.asarray(reps).astype(np.int64, copy=False)
    L = reps.shape[0]
    reps = reps.reshape(L, -1)
    per_layer = reps.sum(axis=1)
    N = int(n_occ)
    ctas, split = per_layer.astype(np.float64), (reps > 1).any(axis=1)
    if not per_layer.any():
        z = np.zeros(0, dtype=np.intp)
        return _frozen(WaveLaunch(reps.astype(np.float64), np.zeros(L, dtype=np.int64), z,
                                  z.copy(), N, 0, True, ctas, split, False, z, z.copy(), 0))
    waves = -(-per_layer // N)
    tail_n = per_layer - N * np.maximum(0, waves - 1)  # CTAs of the last wave, per layer
    # entry i's CTAs sit at launch positions counted from the layer's end in [after_i, after_i + reps_i)
    k = np.cumsum(reps, axis=1)
    np.subtract(per_layer[:, None], k, out=k)  # after_i
    np.subtract(tail_n[:, None], k, out=k)
    np.maximum(k, 0, out=k)
    np.minimum(k, reps, out=k)  # CTAs of entry i in the tail
    # the tails are the rows' last entries: gather them from the columns some row's tail reaches only
    kf = k.ravel()
    nz = np.flatnonzero(kf)
    cnt = kf[nz]
    src = np.repeat(nz, cnt)
    row = src // reps.shape[1]
    start = np.concatenate(([0], np.cumsum(tail_n)[:-1]))
    col = np.arange(src.size) - start[row]
    w = int(tail_n.max())
    dst = row * w + col
    first = (N - tail_n).astype(np.intp)
    erow = nz // reps.shape[1]  # the tail's entries, row by row in launch order
    per_row = np.bincount(erow, minlength=L)
    we = int(per_row.max())
    if 8 * we <= w:  # measured: the argsort and gathers pay only for ~8 or more CTAs an entry
        ecol = np.arange(nz.size) - np.concatenate(([0], np.cumsum(per_row)[:-1]))[erow]
        tdst = erow * we + ecol
        tcnt = np.zeros((L, we))
        tcnt.reshape(-1)[tdst] = cnt
        return _frozen(WaveLaunch(reps.astype(np.float64), waves, src, dst, N, w, False, ctas, split, True, nz, tdst,
                                  we, tcnt, first))
    return _frozen(WaveLaunch(reps.astype(np.float64), waves, src, dst, N, w, False, ctas, split, False, src, dst, w,
                              None, first))


def _frozen(launch: WaveLaunch) -> WaveLaunch:
    for a in (launch.reps, launch.waves, launch.src, launch.dst, launch.ctas, launch.split, launch.tsrc,
              launch.tdst, launch.tcnt, launch.first):
        if a is not None:
            a.flags.writeable = False
    return launch


def launch_wave_time(size_bytes: np.ndarray, launch: WaveLaunch, bw: float, cta_bw: float,
                     cta_s: float = 0.0, rate_model: str = "capped") -> np.ndarray:
    """:func:`wave_time` of sizes ``size_bytes`` [L, n] (float64) on a launch of :func:`wave_launch`; the tail's
    CTAs share the bandwidth by ``rate_model`` (:class:`DecodeCosts`)."""
    L = size_bytes.shape[0]
    if launch.empty:
        return np.zeros(L)
    total = (size_bytes * launch.reps).sum(axis=1)
    return tail_wave_time(total, size_bytes.reshape(-1)[launch.tsrc], launch, bw, cta_bw, cta_s, rate_model)


def tail_wave_time(total: np.ndarray, tail: np.ndarray, launch: WaveLaunch, bw: float, cta_bw: float,
                   cta_s: float = 0.0, rate_model: str = "capped") -> np.ndarray:
    """:func:`launch_wave_time` from the two things it reads of the sizes: each row's bytes (``total`` [..., L],
    all its CTAs) and the bytes of the last wave's CTAs (``tail`` [..., m], in ``launch.tsrc`` order: one per CTA,
    or one per entry when ``launch.grouped``). A caller that knows a row's bytes without its CTAs' (the simulator:
    the CTAs of a head split its tokens, so a layer's bytes are its heads' tokens) prices a launch in the size of
    its last wave instead of all its CTAs. Leading axes price several size sets of one launch at once, each exactly
    as alone (every reduction runs along the last axis, row by row)."""
    total = np.asarray(total, dtype=np.float64)
    lead, L = total.shape[:-1], total.shape[-1]
    if launch.empty:
        return np.zeros(total.shape)
    N, w = launch.n_occ, launch.twidth
    rates = _tail_rates(N, float(bw), float(cta_bw), rate_model)
    # a last wave of N slots holds its CTAs after zero padding, so only the longest tail's w columns are sized
    sub = np.zeros(lead + (L, w))
    # placed one size set at a time: numpy's 1-d fancy assignment takes ~40% of the time of its [..., idx] form here
    # (3,480 CTAs into 32 x 168: 5 vs 12 us)
    rows, src = sub.reshape(-1, L * w), np.reshape(tail, (-1, np.shape(tail)[-1]))
    for i in range(rows.shape[0]):
        rows[i][launch.tdst] = src[i]
    if launch.grouped:  # entries of equal CTAs: sorted, entry j's size step is paid at its first CTA's position
        body = (total - (sub * launch.tcnt).sum(axis=-1)) / bw
        order = sub.argsort(axis=-1, kind="stable")
        sub = np.take_along_axis(sub, order, axis=-1)
        cnt = np.take_along_axis(np.broadcast_to(launch.tcnt, sub.shape), order, axis=-1)
        pos = np.cumsum(cnt, axis=-1)
        pos -= cnt
        rate = rates[np.minimum(pos.astype(np.intp) + launch.first[:, None], N - 1)]
    else:  # sorted, the j-th smallest CTA finishes while N - (N - w + j) others still run
        body = (total - sub.sum(axis=-1)) / bw
        sub.sort(axis=-1)
        rate = rates[N - w:]
    diffs = np.empty(lead + (L, w))  # np.diff(sub, prepend=0), without the concatenation
    diffs[..., 0] = sub[..., 0]
    np.subtract(sub[..., 1:], sub[..., :-1], out=diffs[..., 1:])
    diffs *= rate
    out = body + diffs.sum(axis=-1)
    if cta_s:
        out += launch.waves * cta_s
    return out


@lru_cache(maxsize=64)
def _tail_rates(n: int, bw: float, cta_bw: float, rate_model: str = "capped") -> np.ndarray:
    """Seconds per byte of the j-th smallest CTA of a last wave of ``n``: bandwidth shared by the ``n - j`` still
    running, each capped at one CTA's rate (``"capped"``), or together streaming ``bw * (1 - exp(-a * cta_bw /
    bw))`` (``"saturating"``, :class:`DecodeCosts`). Read-only: shared between calls."""
    active = n - np.arange(n)  # CTAs still running while the j-th smallest finishes
    if rate_model == "saturating":
        out = active / (bw * -np.expm1(-active * (cta_bw / bw)))
    else:
        out = np.maximum(active / bw, 1.0 / cta_bw)
    out.flags.writeable = False
    return out


def dispatch_time(sizes, n_occ: int, bw: float, cta_bw: float, rate_model: str = "saturating") -> float:
    """Seconds of one launch whose CTAs of ``sizes`` bytes (in launch order) the GPU dispatches one by one into
    ``n_occ`` resident slots, each starting the moment a slot frees, the running ones sharing the bandwidth by
    ``rate_model`` (:func:`_tail_rates`' rates; ``a`` running CTAs each stream ``bw (1 - exp(-a cta_bw / bw)) / a``).

    A reference model of launch order, not the simulator's price (an event loop per launch): unlike the waves and
    straggler tail of :func:`tail_wave_time`, which size only the last ``n_occ`` CTAs, a long CTA dispatched late
    runs past the others whatever wave it is in, so request-major and longest-first launches of the same CTAs
    differ. Against the H200's measured kernels (``benchmarks/decode_order_model.py``,
    reports/engine/roofline/README.md) it predicts request / longest-first 1.08x at batch 64 x 8K (1.13x measured;
    the waves model 1.03x) and 1.05x at 128 x 8K (1.08x), but 1.02x at 256 x 2K where longest first measured 0.98x;
    it has no per-launch or per-CTA constants and no per-SM placement (which CTAs share an SM in one wave: what
    orders one-wave launches), so compare orders with it, not absolute times."""
    import heapq

    sizes = np.asarray(sizes, dtype=np.float64).ravel()
    n, N = sizes.size, int(n_occ)
    if n == 0:
        return 0.0
    if N < 1:
        raise ConfigError(f"dispatch_time: n_occ must be >= 1, got {n_occ}")
    a = np.arange(1, min(n, N) + 1, dtype=np.float64)
    per_cta = bw * -np.expm1(-a * (cta_bw / bw)) / a if rate_model == "saturating" else np.minimum(bw / a, cta_bw)
    # every running CTA advances by the same bytes ("virtual" bytes v): a CTA started at v0 ends at v0 + size
    ends = list(sizes[:N])
    heapq.heapify(ends)
    v = t = 0.0
    nxt = min(n, N)
    while ends:
        e = heapq.heappop(ends)
        t += (e - v) / per_cta[len(ends)]  # len(ends) + 1 CTAs ran until this one ended
        v = e
        if nxt < n:
            heapq.heappush(ends, v + sizes[nxt])
            nxt += 1
    return t


def decode_layer_times(lens: np.ndarray, S: np.ndarray, heads_per_group: int, batch: int, n_occ: int,
                       costs: DecodeCosts, *, gq: int, head_dim: int, dtype_bytes: int = 2) -> np.ndarray:
    """Predicted seconds per layer [L] of one decode launch: ``batch`` requests whose heads hold ``lens``
    [L, H] tokens (slot order), split as ``S`` [L, G] (every head of group g gets S[l, g] page-aligned pieces).
    The batch's CTAs in launch order (request, slot, split) priced by :func:`launch_layer_times`, the arithmetic
    the simulator prices every decode step with."""
    lens = np.asarray(lens, dtype=np.float64)
    per_head = np.repeat(np.asarray(S, dtype=np.int64), heads_per_group, axis=1)  # [L, H]
    size = lens / per_head * (2 * head_dim * dtype_bytes)
    if batch > 1:
        size, per_head = np.tile(size, (1, batch)), np.tile(per_head, (1, batch))
    return launch_layer_times(size, wave_launch(per_head, n_occ), costs, gq=gq, head_dim=head_dim)


def launch_layer_times(size_bytes: np.ndarray, launch: WaveLaunch, costs: DecodeCosts, *, gq: int,
                       head_dim: int, fixed: np.ndarray | None = None) -> np.ndarray:
    """Seconds per row (layer) of a decode launch whose CTAs, of ``size_bytes`` [L, n] bytes each (float64), come
    as :func:`wave_launch` laid them out: the waves and straggler tail of :func:`launch_wave_time` at the costs'
    bandwidth, lone-CTA rate and rate model, one launch, and where a head is split the merge kernel (``merge_s``
    plus the fp32 partials, each ``gq x (head_dim + 2)`` floats, written by the first kernel and read by the
    merge). One model of the kernel: the AOT regime choice (:func:`decode_layer_times`, engine and simulator),
    the decode-cost fit (``tangram.sim.fit_decode``) and the simulator's price of every decode step call it."""
    L = size_bytes.shape[0]
    total = (size_bytes * launch.reps).sum(axis=1) if not launch.empty else np.zeros(L)
    return tail_layer_times(total, size_bytes.reshape(-1)[launch.tsrc], launch, costs, gq=gq, head_dim=head_dim,
                            fixed=fixed)


def tail_layer_times(total: np.ndarray, tail: np.ndarray, launch: WaveLaunch, costs: DecodeCosts, *, gq: int,
                     head_dim: int, fixed: np.ndarray | None = None) -> np.ndarray:
    """:func:`launch_layer_times` from each row's bytes and its last wave's CTAs' (:func:`tail_wave_time`)."""
    t = tail_wave_time(total, tail, launch, costs.bw, costs.cta_bw, 0.0, costs.rate_model)
    # ``fixed``: this launch's launch_fixed_times, kept by a caller that prices one launch shape again and again
    return t + (launch_fixed_times(launch, costs, gq=gq, head_dim=head_dim) if fixed is None else fixed)


def launch_fixed_times(launch: WaveLaunch, costs: DecodeCosts, *, gq: int, head_dim: int) -> np.ndarray:
    """The part of :func:`launch_layer_times` that does not grow with the CTAs' bytes, per row: ``cta_s`` per
    wave, the launch, and where a head is split the merge with its partials (the simulator's rescale cache keeps
    it fixed while a running batch's tokens grow)."""
    partial = launch.ctas * (gq * (head_dim + 2) * 4 * 2)
    return launch.waves * costs.cta_s + costs.launch_s + np.where(launch.split, costs.merge_s + partial / costs.bw,
                                                                  0.0)


SPLIT_CANDIDATE_WAVES = (0.5, 1.0, 2.0, 4.0)
SPLIT_CANDIDATE_TOKENS = (64, 128, 256, 512)
SPLIT_CANDIDATE_UNIFORM = (2, 4, 8, 16, 32)
SPLIT_MARGIN = DecodeCosts.margin  # default predicted gain a map needs over the FlashDecoding split (DecodeCosts.margin)


SPLIT_CANDIDATE_BALANCED = (1, 2)  # FlashInfer's balanced chunking at k x the resident CTAs
SPLIT_CANDIDATE_EVEN = (2, 4, 8)  # every head split alike, beyond FlashDecoding's choice


def split_candidates(B: np.ndarray, perm: np.ndarray, heads_per_group: int, n_occ: int, bucket: int, *,
                     context: int, min_split_tokens: int = AOT_MIN_SPLIT_TOKENS, max_splits: int = AOT_MAX_SPLITS,
                     num_sms: int | None = None, head_dim: int = 128, lens: np.ndarray | None = None
                     ) -> dict[str, np.ndarray]:
    """Named split maps [L, G] for one (batch bucket, context bucket), all computable before serving (the budgets
    are static): FlashDecoding's split (``static``, with ``num_sms``), Algorithm 1 at :data:`SPLIT_CANDIDATE_WAVES`
    capped at ``min_split_tokens`` a CTA (``alg1_w{w}``), FlashInfer's balanced chunking computed once from the
    retained lengths at k x ``n_occ`` CTAs (``balanced_x{k}``: its per-head splits, a group taking its heads'
    most), and even splits (``uniform_s{s}``). ``lens`` [L, H] slot order: the lengths the balanced chunking sees
    (default: the budgets at 3/4 of ``context``, where the routing prices). The routing chooses among these, and
    benchmarks/aot_ceiling.py times each against ``static`` to measure its ratio margins."""
    B = np.asarray(B, dtype=np.float64)
    Bg = np.take_along_axis(B, np.asarray(perm), axis=1)
    L, H = Bg.shape
    G = H // heads_per_group
    gmax = Bg.reshape(L, G, heads_per_group).max(axis=2)
    cap = np.clip(np.floor(np.ceil(gmax * context) / min_split_tokens), 1, max_splits).astype(np.int32)
    out: dict[str, np.ndarray] = {}
    if num_sms:
        block_n = split_kv_block(head_dim)
        longest = int(np.ceil(Bg.max() * context))  # at the bucket's edge, where FlashDecoding would see it
        ns = flashdecoding_num_splits(bucket * H, num_sms, max(1, -(-longest // block_n)))
        out["static"] = np.full((L, G), ns, dtype=np.int32)
    for w in SPLIT_CANDIDATE_WAVES:
        S = aot_split_map(B, perm, heads_per_group, aot_n_cta(n_occ, bucket, heads_per_group, w), "round")
        out[f"alg1_w{w:g}"] = np.minimum(S, cap).astype(np.int32)
    if lens is None:
        lens = np.maximum(1.0, np.ceil(Bg * 0.75 * context))
    lens = np.asarray(lens, dtype=np.int64)
    for k in SPLIT_CANDIDATE_BALANCED:
        rp = runtime_plan(np.broadcast_to(lens[None], (bucket, L, H)), k * n_occ)
        per_head = np.stack([sp[0] for sp in rp.splits])  # [L, H]: every request alike
        out[f"balanced_x{k}"] = per_head.reshape(L, G, heads_per_group).max(axis=2).astype(np.int32)
    for sp in SPLIT_CANDIDATE_EVEN:
        out[f"uniform_s{sp}"] = np.full((L, G), sp, dtype=np.int32)
    return out


_ROUTED: dict = {}  # routed maps by their inputs: a capacity search builds the same maps for every replay


def aot_bucket_split_map(B: np.ndarray, perm: np.ndarray, heads_per_group: int, n_occ: int, bucket: int, *,
                         waves: float = 1.0, rounding: str = "round", context: int = AOT_MAX_CONTEXT,
                         min_split_tokens: int = AOT_MIN_SPLIT_TOKENS, max_splits: int = AOT_MAX_SPLITS,
                         costs: DecodeCosts | None = None, gq: int = 4, head_dim: int = 128,
                         dtype_bytes: int = 2, num_sms: int | None = None) -> np.ndarray:
    """:func:`_aot_bucket_split_map`, the routed maps (``costs`` given, ~20 ms each with the candidate search) kept
    per process by their inputs; a fresh copy is returned."""
    if costs is None:
        return _aot_bucket_split_map(B, perm, heads_per_group, n_occ, bucket, waves=waves, rounding=rounding,
                                     context=context, min_split_tokens=min_split_tokens, max_splits=max_splits)
    Bf, pa = np.ascontiguousarray(B, dtype=np.float64), np.ascontiguousarray(perm, dtype=np.int64)
    key = (Bf.tobytes(), Bf.shape, pa.tobytes(), heads_per_group, n_occ, bucket, float(waves), rounding, context,
           min_split_tokens, max_splits, costs, gq, head_dim, dtype_bytes, num_sms)
    S = _ROUTED.get(key)
    if S is None:
        S = _aot_bucket_split_map(Bf, pa, heads_per_group, n_occ, bucket, waves=waves, rounding=rounding,
                                  context=context, min_split_tokens=min_split_tokens, max_splits=max_splits,
                                  costs=costs, gq=gq, head_dim=head_dim, dtype_bytes=dtype_bytes, num_sms=num_sms)
        if len(_ROUTED) >= 1024:
            _ROUTED.pop(next(iter(_ROUTED)))
        _ROUTED[key] = S
    return S.copy()


def _aot_bucket_split_map(B: np.ndarray, perm: np.ndarray, heads_per_group: int, n_occ: int, bucket: int, *,
                          waves: float = 1.0, rounding: str = "round", context: int = AOT_MAX_CONTEXT,
                          min_split_tokens: int = AOT_MIN_SPLIT_TOKENS, max_splits: int = AOT_MAX_SPLITS,
                          costs: DecodeCosts | None = None, gq: int = 4, head_dim: int = 128,
                          dtype_bytes: int = 2, num_sms: int | None = None) -> np.ndarray:
    """The split map the engine launches for a batch bucket and context bucket. The engine's split table and
    the simulator's cost model both call this, so they price and launch the same CTAs.

    Without ``costs``: Algorithm 1 at :func:`aot_n_cta`, each group capped at its longest head's retained
    tokens at ``context`` over ``min_split_tokens`` (and ``max_splits``).

    With ``costs`` (PersistentKV's regime routing, ahead of time): per layer, the cheapest by
    :func:`decode_layer_times`, priced at 3/4 of the context bucket (its contexts lie in (c/2, c]), of no split
    (one pass, no merge kernel), Algorithm 1's split above, and FlashDecoding's own split of every head (the
    static baseline's CTAs, when ``num_sms`` is given), which is kept unless another is predicted
    ``costs.margin`` faster (the fit's p90 error on this GPU): the map never trades the baseline for a gain inside
    the model's error (measured on the H100: AOT 0.82-0.91x static at batch 1-4 below 8K when the model alone
    chose, 0.90-0.95x at batch 1 / 8K with a 5% margin). When the baseline's map is kept, the kernel launches
    exactly the static split's CTAs (one launch and no merge when it does not split). Without ``num_sms`` the
    search also covers Algorithm 1 at :data:`SPLIT_CANDIDATE_WAVES` x the caps :data:`SPLIT_CANDIDATE_TOKENS` and
    uniform splits :data:`SPLIT_CANDIDATE_UNIFORM`."""
    B = np.asarray(B, dtype=np.float64)
    Bg = np.take_along_axis(B, np.asarray(perm), axis=1)
    gmax = Bg.reshape(Bg.shape[0], -1, heads_per_group).max(axis=2)  # [L, G] longest head of each group

    def cap(T: int) -> np.ndarray:
        return np.clip(np.floor(np.ceil(gmax * context) / T), 1, max_splits).astype(np.int32)

    def alg1(w: float) -> np.ndarray:
        return aot_split_map(B, perm, heads_per_group, aot_n_cta(n_occ, bucket, heads_per_group, w), rounding)

    S0 = np.minimum(alg1(waves), cap(min_split_tokens))
    if costs is None:
        return S0
    cands = [S0, np.ones_like(S0)]
    lens = np.maximum(1.0, np.ceil(Bg * 0.75 * context))
    if not num_sms:  # no baseline to fall back on: search finer and coarser maps too
        for w in dict.fromkeys((waves,) + SPLIT_CANDIDATE_WAVES):
            a = alg1(w)
            cands += [np.minimum(a, cap(T)) for T in SPLIT_CANDIDATE_TOKENS]
        c64 = cap(64)
        cands += [np.minimum(np.full_like(S0, s), c64) for s in SPLIT_CANDIDATE_UNIFORM]
    static = None
    if num_sms:  # FlashDecoding's own split, every head alike: the baseline's CTAs exactly, and the maps of
        # split_candidates (those benchmarks/aot_ceiling.py times against it: the ratio margins are theirs)
        named = split_candidates(B, perm, heads_per_group, n_occ, bucket, context=context,
                                 min_split_tokens=min_split_tokens, max_splits=max_splits, num_sms=num_sms,
                                 head_dim=head_dim, lens=lens)
        static = named.pop("static")
        cands += list(named.values()) + [static]
    cands = list({S.tobytes(): S for S in cands}.values())  # distinct maps, first occurrence kept (S0 first)
    times = np.stack([decode_layer_times(lens, S, heads_per_group, bucket, n_occ, costs, gq=gq, head_dim=head_dim,
                                         dtype_bytes=dtype_bytes) for S in cands])  # [n_cand, L]
    if static is not None:
        # under one wave, fewer CTAs than the baseline leave SMs idle: the model's lone-CTA rate is least certain
        # there (measured on the H100: 102 vs 120 CTAs at batch 1 ran 0.95x), so such maps are not candidates
        ctas = np.stack([S.sum(axis=1) * heads_per_group * bucket for S in cands])  # [n_cand, L]
        st_ctas = static.sum(axis=1) * heads_per_group * bucket
        times = np.where((ctas < st_ctas[None, :]) & (st_ctas[None, :] <= n_occ), np.inf, times)
    best = times.argmin(axis=0)  # first (Algorithm 1 at the configured waves) on ties
    out = np.stack(cands)[best, np.arange(S0.shape[0])].astype(np.int32)
    if static is not None:  # keep the baseline's split unless the model predicts a clear gain (beyond its error)
        t_static = decode_layer_times(lens, static, heads_per_group, bucket, n_occ, costs, gq=gq, head_dim=head_dim,
                                      dtype_bytes=dtype_bytes)
        keep = times.min(axis=0) > (1.0 - costs.margin_for(bucket)) * t_static
        out[keep] = static[keep]
    return out


FLASHDECODING_SM_FACTOR = 2  # flash_api.cpp: "We multiply number of SMs by 2 to hard-code ... 128 threads per block"


def split_kv_block(head_dim: int) -> int:
    """flash-attn's split-KV block (``block_n``) for a head dimension: the tokens FlashDecoding's num_splits
    counts a sequence in (256 for d <= 64, 128 for d <= 128, else 64)."""
    return 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)


def flashdecoding_num_splits(batch_nheads: int, num_sms: int, num_n_blocks: int, max_splits: int = 128) -> int:
    """FlashAttention-2's ``num_splits_heuristic`` as ``set_params_splitkv`` (flash_api.cpp, v2.6 on) calls it,
    applied to every head alike.

    ``num_sms`` is the device's SM count: FlashAttention-2 passes the heuristic twice that (its split-KV kernel runs
    128-thread blocks, two per SM), so a launch counts as full from 0.8 x 2 x SMs (request, head) pairs, not 0.8 x
    SMs (this function took the SM count as is until 2026-11-27, a weaker baseline between the two: e.g. one split
    instead of two at batch 16 x 8 KV heads on 132 SMs). ``batch_nheads`` counts (request, KV head) pairs of the
    launch (decode with GQA packs a KV head's query heads into one block, as FlashAttention-2's
    ``seqlenq_ngroups_swapped``), ``num_n_blocks`` the KV blocks of the longest sequence. Picks the fewest splits
    whose wave efficiency is within 85% of the best.
    """
    num_sms = FLASHDECODING_SM_FACTOR * int(num_sms)
    if batch_nheads >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, max(1, num_n_blocks))

    def eligible(s: int) -> bool:
        return s == 1 or -(-num_n_blocks // s) != -(-num_n_blocks // (s - 1))

    eff = np.zeros(max_splits + 1)
    best = 0.0
    for s in range(1, max_splits + 1):
        if not eligible(s):
            continue
        waves = batch_nheads * s / num_sms
        eff[s] = waves / np.ceil(waves)
        best = max(best, eff[s])
    for s in range(1, max_splits + 1):
        if eligible(s) and eff[s] >= 0.85 * best:
            return s
    return 1


@dataclass
class RuntimePlan:
    """Per-layer split counts for every (request, head) and the host work spent finding them."""

    splits: list[np.ndarray]  # per layer: [R, H] chunks per (request, head)
    chunk_tokens: np.ndarray  # [L] the chunk size chosen for each layer
    host_items: int  # (request, head) work items scanned, summed over layers and search iterations
    search_iters: int


def runtime_plan(lengths: np.ndarray, n_cta: int, min_chunk: int = 16) -> RuntimePlan:
    """FlashInfer-style balanced split-KV plan, recomputed for each layer.

    For each layer, binary-search the largest chunk size whose chunk count fits
    ``n_cta`` CTAs, then split every (request, head) into chunks of that size.
    ``lengths`` is [R, L, H] retained tokens. The loop over layers is the point:
    non-uniform lengths differ per layer, so one plan cannot be reused across
    layers the way FlashInfer reuses it for uniform caches.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 3:
        raise ConfigError(f"lengths must be [R, L, H], got {lengths.shape}")
    R, L, H = lengths.shape
    # every layer's binary search at once (a layer per row of ``x``), each layer's bounds, steps and counts exactly
    # as a search of its own: the simulator runs this planner at every decode step, and a loop over the layers of
    # numpy calls made a Mooncake window 60x slower than the other partitions
    x = np.ascontiguousarray(lengths.transpose(1, 0, 2)).reshape(L, R * H)
    lo = np.full(L, min_chunk, dtype=np.int64)
    hi = np.maximum(min_chunk, x.max(axis=1)) if x.size else lo.copy()
    items, iters = 0, 0
    act = np.flatnonzero(lo < hi)  # layers still searching: smallest chunk whose chunk count fits n_cta
    while act.size:
        mid = (lo[act] + hi[act]) // 2
        n = np.maximum(1, -(-x[act] // mid[:, None])).sum(axis=1)
        items += act.size * x.shape[1]
        iters += act.size
        fits = n <= n_cta
        hi[act[fits]] = mid[fits]
        lo[act[~fits]] = mid[~fits] + 1
        act = act[lo[act] < hi[act]]
    per = np.maximum(1, -(-x // lo[:, None])).astype(np.int32).reshape(L, R, H)
    splits = list(per)  # per layer [R, H], contiguous
    items += L * R * H
    chunks = lo
    return RuntimePlan(splits, chunks, items, iters)
