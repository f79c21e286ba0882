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

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def layer_pool(self, layer: int) -> torch.Tensor:
        return self.pool if self.layout.ragged else self.pool[:, layer]

    def tables(self, pages: np.ndarray) -> torch.Tensor:
        """Block-table rows ``[B, T, cap]`` (int32, -1 = no page) to the device in one copy."""
        return self.to_device(np.asarray(pages, dtype=np.int32))

    def to_device(self, a: np.ndarray) -> torch.Tensor:
        """Host array to the device through pinned memory (a pageable copy would sync the stream)."""
        t = torch.from_numpy(np.ascontiguousarray(a))
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
