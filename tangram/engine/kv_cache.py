"""The device KV pool of one engine replica, shaped by the scheduler's layout.

* ragged (``br+rp``, ``tangram``): ``[num_pages, 2, H_p, P, d]``, one page per
  (layer, head group) table; table ``t = l*G + g`` of a block-table row.
* monolithic (``full``, ``uniform``, ``dynamic``, ``br``): ``[num_pages, L, 2, H, P, d]``,
  one page spans every layer and head; a layer is the strided view ``pool[:, l]``.

Every kernel sees a layer as ``(pool [pages, 2, H_p, P, d], table [B, G, cap])``
(monolithic: ``H_p = H``, ``G = 1``), so the executor has one code path.
"""
from __future__ import annotations

import numpy as np
import torch

from tangram.paging import KVLayout


class KVCache:
    def __init__(self, layout: KVLayout, num_pages: int, dtype: torch.dtype, device: torch.device | str):
        self.layout = layout
        L, H, P, d = layout.num_layers, layout.num_kv_heads, layout.page_size, layout.head_dim
        self.G = layout.n_groups
        self.hp = layout.heads_per_group
        if layout.ragged:
            shape = (num_pages, 2, self.hp, P, d)
        else:
            shape = (num_pages, L, 2, H, P, d)
        # NaN-poisoned: a read of a slot nobody wrote shows up in the logits instead of passing silently
        self.pool = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.device = torch.device(device)
        # slot -> KV head per layer, and its inverse, on the device once
        self.slot_to_head = torch.as_tensor(layout.perm, dtype=torch.int32, device=device)  # [L, H]
        self.perm_long = self.slot_to_head.long()
        self.head_to_slot = torch.argsort(self.perm_long, dim=1).to(torch.int32)  # [L, H]
        self.slot_j = (torch.arange(H, device=device) % self.hp)[None, :]  # slot -> head index inside its page
        self._stage: torch.Tensor | None = None  # pinned host staging bytes of upload(), reused every step
        self._stage_done = torch.cuda.Event() if self.device.type == "cuda" else None
        self._stage_busy = False

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def layer_pool(self, layer: int) -> torch.Tensor:
        return self.pool if self.layout.ragged else self.pool[:, layer]

    def stacked_pool(self) -> torch.Tensor:
        """Every layer's :meth:`layer_pool` as one ``[L, ...]`` view (ragged: the one pool, layer stride 0)."""
        L = self.layout.num_layers
        return self.pool.expand(L, *self.pool.shape) if self.layout.ragged else self.pool.transpose(0, 1)

    def stacked_tables(self, tables: torch.Tensor) -> torch.Tensor:
        """Every layer's :meth:`layer_table` of the step's ``[B, T, cap]`` rows as one ``[B, L, G, cap]`` view."""
        B, L = tables.shape[0], self.layout.num_layers
        if self.layout.ragged:
            return tables.view(B, L, self.G, tables.shape[2])
        return tables[:, None].expand(B, L, *tables.shape[1:])  # T = 1 = G: one table for every layer

    def tables(self, pages: np.ndarray) -> torch.Tensor:
        """Block-table rows ``[B, T, cap]`` (int32, -1 = no page) to the device in one copy."""
        return self.to_device(np.asarray(pages, dtype=np.int32))

    def upload(self, arrays: dict, dtype=np.int32) -> dict[str, torch.Tensor]:
        """Every array to the device in one host-to-device copy out of a pinned staging buffer that lives as long
        as the cache (a step's inputs cost no pinned allocation, no pointer query and one copy); device views by
        name. The buffer is refilled only after the previous copy out of it finished (an event)."""
        flat = [np.asarray(a).reshape(-1) for a in arrays.values()]
        n = sum(f.size for f in flat)
        item = np.dtype(dtype).itemsize
        if self.device.type != "cuda":
            buf = torch.from_numpy(np.concatenate(flat).astype(dtype) if flat else np.zeros(0, dtype))
        else:
            if self._stage is None or self._stage.numel() < n * item:
                self._stage = torch.empty(max(n * item, 2 * (0 if self._stage is None else self._stage.numel()),
                                              1 << 20), dtype=torch.uint8, pin_memory=True)
                self._stage_busy = False
            if self._stage_busy:
                self._stage_done.synchronize()
            host = self._stage.numpy()[: n * item].view(dtype)
            off = 0
            for f in flat:
                host[off:off + f.size] = f
                off += f.size
            buf = torch.empty(n * item, dtype=torch.uint8, device=self.device)
            buf.copy_(self._stage[: n * item], non_blocking=True)
            self._stage_done.record()
            self._stage_busy = True
            buf = buf.view(getattr(torch, np.dtype(dtype).name))
        out, off = {}, 0
        for (name, a), f in zip(arrays.items(), flat):
            out[name] = buf[off:off + f.size].view(np.shape(a))
            off += f.size
        return out

    def to_device(self, a: np.ndarray) -> torch.Tensor:
        """Host array to the device through pinned memory (a pageable copy would sync the stream)."""
        a = np.ascontiguousarray(a)
        if not a.flags.writeable:  # a plan's read-only arrays (the scheduler's cached batch): torch wants its own
            a = a.copy()
        t = torch.from_numpy(a)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def layer_table(self, tables: torch.Tensor, layer: int) -> torch.Tensor:
        """``[B, G, cap]`` of one layer from the step's ``[B, T, cap]`` rows."""
        if self.layout.ragged:
            return tables[:, layer * self.G:(layer + 1) * self.G]
        return tables  # T = 1 = G

    def decode_slots(self, tables: torch.Tensor, lens_after: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Page and in-page offset of every head's new token for all layers at once: ([B, L, H], [B, L, H]).

        Computed once per step so each layer's write is two indexed stores (launch overhead dominates decode).
        """
        B, L, H = lens_after.shape
        pos = lens_after.long() - 1
        slots = torch.arange(H, device=tables.device)
        if self.layout.ragged:
            t_idx = torch.arange(L, device=tables.device)[:, None] * self.G + (slots // self.hp)[None, :]
        else:
            t_idx = torch.zeros((L, H), dtype=torch.long, device=tables.device)
        b_idx = torch.arange(B, device=tables.device)[:, None, None]
        page = tables[b_idx, t_idx[None], pos // self.layout.page_size].long()
        return page, pos % self.layout.page_size

    def copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Whole pages (every layer and head they span) ``src[i]`` -> ``dst[i]`` in one index copy."""
        d = self.to_device(np.asarray(dst, dtype=np.int64))
        self.pool.index_copy_(0, d, self.pool.index_select(0, self.to_device(np.asarray(src, dtype=np.int64))))

    def write_decode(self, layer: int, page: torch.Tensor, off: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """Each head's new token at its own position (slot order); ``page``/``off`` [B, H] of this layer,
        k/v [B, H, d] in KV-head order."""
        pool = self.layer_pool(layer)
        heads = self.perm_long[layer]
        j = self.slot_j
        pool[page, 0, j, off] = k.index_select(1, heads).to(pool.dtype)
        pool[page, 1, j, off] = v.index_select(1, heads).to(pool.dtype)
