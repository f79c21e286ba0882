"""Time ``torch.distributed.all_reduce`` over message sizes and write ``allreduce.csv`` for the simulator.

    torchrun --nproc-per-node 2 -m tangram.sim.fit_allreduce --out sim/tables/h200   # NCCL on 2 GPUs
    python -m tangram.sim.fit_allreduce --cpu --world 2 --out /tmp/ar                    # gloo on the CPU (a check)

Each size is reduced ``--iters`` times after ``--warmup`` calls; a rank's time per call is the median of
``--repeats`` timed batches, and the row is the slowest rank's (a collective ends when its last rank does). Rows
are ``tp, bytes, median_us, dtype, backend, gpu, date, command`` (the last five the provenance the cost model repeats
in ``cost_model_source``); existing rows of other ``tp`` values in the file are kept, rows of this ``tp`` replaced.
The sizes default to the all-reduces a step of Llama-3.1-8B/70B makes: ``tokens x hidden x 2`` bytes for 1 to 16K
tokens. ``tangram.sim.tp`` reads the file from the tables folder of the GPU being priced.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import time
from pathlib import Path

import numpy as np

from tangram.cli import Parser, cli_main, parse
from tangram.errors import ConfigError

DEFAULT_SIZES = [int(t * 4096 * 2) for t in (1, 4, 16, 64, 256, 1024, 4096, 16384)]


def measure(sizes, *, warmup: int = 5, iters: int = 20, repeats: int = 5, dtype: str = "bfloat16") -> list[float]:
    """Median seconds per all-reduce of each size on this process's group (call on every rank)."""
    import torch
    import torch.distributed as dist

    cuda = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dt = getattr(torch, dtype)
    elem = torch.tensor([], dtype=dt).element_size()
    out = []
    for nbytes in sizes:
        x = torch.ones(max(1, int(nbytes) // elem), dtype=dt, device=dev)
        for _ in range(warmup):
            dist.all_reduce(x)
        times = []
        for _ in range(repeats):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            if cuda:
                torch.cuda.synchronize(dev)
            times.append((time.perf_counter() - t) / iters)
        mine = torch.tensor([float(np.median(times))], dtype=torch.float64)
        if cuda:
            mine = mine.to(dev)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        out.append(float(mine.item()))
    return out


def write_csv(path: Path, tp: int, sizes, seconds, *, dtype: str, backend: str, gpu: str, command: str) -> Path:
    """Replace this ``tp``'s rows of ``path`` (others kept)."""
    import pandas as pd

    path = Path(path)
    rows = pd.DataFrame({"tp": tp, "bytes": [int(s) for s in sizes], "median_us": [s * 1e6 for s in seconds],
                         "dtype": dtype, "backend": backend, "gpu": gpu, "date": _dt.date.today().isoformat(),
                         "command": command})
    if path.exists():
        old = pd.read_csv(path)
        rows = pd.concat([old[old["tp"] != tp], rows], ignore_index=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows.to_csv(path, index=False)
    return path


def _worker(rank: int, world: int, port: int, a, q) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        s = measure(a.sizes, warmup=a.warmup, iters=a.iters, repeats=a.repeats, dtype=a.dtype)
        if rank == 0:
            q.put(s)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@cli_main
def main(argv=None) -> int:
    ap = Parser(prog="python -m tangram.sim.fit_allreduce", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="tables folder (allreduce.csv is written there)")
    ap.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="message sizes in bytes")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="spawn --world gloo processes on the CPU (a functional check; "
                                                      "its times are no GPU's)")
    ap.add_argument("--world", type=int, default=2)
    a = parse(ap, argv)
    if any(s <= 0 for s in a.sizes):
        raise ConfigError("--sizes must be positive")
    cmd = "python -m tangram.sim.fit_allreduce " + " ".join(a._argv)
    if a.cpu:
        import torch.multiprocessing as mp

        if a.world < 2:
            raise ConfigError("--world must be >= 2")
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, a.world, port, a, q)) for r in range(a.world)]
        for p in procs:
            p.start()
        secs = q.get(timeout=600)
        for p in procs:
            p.join()
        path = write_csv(Path(a.out) / "allreduce.csv", a.world, a.sizes, secs, dtype=a.dtype, backend="gloo",
                         gpu=f"cpu ({platform.processor() or platform.machine()})", command=cmd)
    else:  # under torchrun: one process per GPU
        import torch
        import torch.distributed as dist

        if "RANK" not in os.environ:
            raise ConfigError("run under torchrun (one process per GPU), or pass --cpu")
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        try:
            secs = measure(a.sizes, warmup=a.warmup, iters=a.iters, repeats=a.repeats, dtype=a.dtype)
            path = None
            if dist.get_rank() == 0:
                path = write_csv(Path(a.out) / "allreduce.csv", dist.get_world_size(), a.sizes, secs, dtype=a.dtype,
                                 backend="nccl", gpu=torch.cuda.get_device_name(local), command=cmd)
        finally:
            dist.destroy_process_group()
        if path is None:
            return 0
    print(f"wrote {path}")
    for s, t in zip(a.sizes, secs):
        print(f"{s:>12d} B  {t * 1e6:10.1f} us")
    return 0


if __name__ == "__main__":
    main()
