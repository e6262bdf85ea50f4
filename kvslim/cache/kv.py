"""The attention layer's KV cache: one preallocated pool of packed pages.

K and V each live in one uint8 tensor of fixed-size pages,
``(n_kv_heads, n_pages + 1, page_size, row_bytes)``, allocated once on the
model's device (enough pages for every slot's whole context; on the CPU the OS
commits them only when written). A slot's pages are listed in its row of the
block table, an int32 tensor on the same device that kernels read; a host
mirror of the same lists decides allocation, so appending never waits on the
device. The last page is the null page, all zeros: every unused block-table
entry points to it, so a kernel reading a whole block never meets another
slot's rows or uninitialised bytes. Heads come first: gathering a block of
pages then yields each head's rows contiguous, ready for one batched matmul.

Optionally the most recent ``f16_window`` tokens of each slot stay in f16
before they are packed; a token leaves the window exactly once, into a page,
and is never re-packed.

The public ``append`` validates its input (one host sync); the model's hot
path, ``forward``, encodes unchecked and raises a per-slot overflow flag on the
device that the engine reads once per step.
"""
from __future__ import annotations

from dataclasses import asdict

import torch

from .. import formats, gpu
from ..formats.base import ceil_div, check_float_input
from ..gpu import kv_append
from ..native import kv_encode
from .attention import op_name
from .spec import KVLayerSpec

DEFAULT_PAGE_SIZE = 256


class KVCache:
    """K/V storage for one attention layer and ``n_slots`` sequences."""

    def __init__(self, spec: KVLayerSpec, ctx: int, n_slots: int = 1, page_size: int = DEFAULT_PAGE_SIZE,
                 f16_window: int = 0, device: torch.device | str = "cpu", backend=None, calibration=None):
        if ctx < 1 or n_slots < 1 or page_size < 1 or f16_window < 0:
            raise ValueError(f"KVCache needs ctx >= 1, n_slots >= 1, page_size >= 1 and f16_window >= 0; "
                             f"got ctx={ctx}, n_slots={n_slots}, page_size={page_size}, f16_window={f16_window}")
        self.spec, self.ctx, self.n_slots = spec, ctx, n_slots
        self.page_size, self.f16_window, self.device = page_size, f16_window, torch.device(device)
        self.fmt_k, self.fmt_v = formats.get(spec.type_k, role="k"), formats.get(spec.type_v, role="v")
        if self.fmt_k.calibrated:
            raise ValueError(f"{self.fmt_k.name} is a V cache type (-ctv): keys coded in a calibrated basis "
                             f"lose to nl3s on text unlike the calibration's; for K use nl4s, q4_0 or turbo4")
        self.fmt_v = self.fmt_v.bind(calibration)              # calibrated formats take their layer's part
        self.op_names = (op_name(self.fmt_k), op_name(self.fmt_v))        # what the DecodeBatch op calls them
        self.pages_per_slot = ceil_div(ctx, page_size)
        self.n_pages = n_slots * self.pages_per_slot
        self.null_page = self.n_pages
        self.k_pool = self._pool(spec.k_row_bytes)
        self.v_pool = self._pool(spec.v_row_bytes)
        self.block_table = torch.full((n_slots, self.pages_per_slot), self.null_page, dtype=torch.int32,
                                      device=self.device)
        self._pages: list[list[int]] = [[] for _ in range(n_slots)]     # host mirror of block_table
        self._free = list(range(self.n_pages - 1, -1, -1))               # pop() hands out low ids first
        self._packed = [0] * n_slots                                     # tokens stored in pages
        self._win_len = [0] * n_slots
        self.win_k = self.win_v = None
        if f16_window:
            shape = (n_slots, f16_window, spec.n_kv_heads, spec.head_dim)
            self.win_k = torch.zeros(shape, dtype=torch.float16, device=self.device)
            self.win_v = torch.zeros(shape, dtype=torch.float16, device=self.device)
        self.overflow = torch.zeros(n_slots, dtype=torch.uint8, device=self.device)
        self.gpu_append = self._gpu_append()
        self.cpu_encoders = self._cpu_encoders()
        from .backends import get_backend                                # backends import this module
        self.backend = get_backend(backend)

    def _gpu_append(self) -> bool:
        """Whether the Triton kernel encodes new rows straight into the pools (a GPU, both formats
        declared to it). Decided once here: the compiled step then traces no check."""
        probe = torch.empty(0, self.n_kv_heads, self.head_dim, device=self.device)
        return gpu.TRITON and kv_append.supports(self.fmt_k, probe) and kv_append.supports(self.fmt_v, probe)

    def _cpu_encoders(self):
        """(K, V) C row encoders for a CPU cache whose formats both have one that writes the torch
        encoder's bytes faster (``kv_encode.PROMPT_KINDS``), else None: a prompt chunk's rows then
        encode in one C call. The torch encoders stay the reference and serve traced graphs,
        other devices and the other formats."""
        if self.device.type != "cpu":
            return None
        encoders = (kv_encode.RowEncoder.for_prompts(self.fmt_k, self.head_dim),
                    kv_encode.RowEncoder.for_prompts(self.fmt_v, self.head_dim))
        return encoders if all(encoders) else None

    def _encode(self, k: torch.Tensor, v: torch.Tensor):
        """Codes and per-token overflow flags of new K and V rows: C on the CPU where it can."""
        if self.cpu_encoders is not None and not torch.compiler.is_compiling():
            (k_codes, k_bad), (v_codes, v_bad) = self.cpu_encoders[0](k), self.cpu_encoders[1](v)
        else:
            (k_codes, k_bad), (v_codes, v_bad) = self.fmt_k.encode_flagged(k), self.fmt_v.encode_flagged(v)
        return k_codes, v_codes, k_bad | v_bad

    def _pool(self, row_bytes: int) -> torch.Tensor:
        pool = torch.empty(self.n_kv_heads, self.n_pages + 1, self.page_size, row_bytes, dtype=torch.uint8,
                           device=self.device)
        pool[:, self.null_page].zero_()
        return pool

    def _rows_view(self, pool: torch.Tensor) -> torch.Tensor:
        """The pool as (n_kv_heads, pool rows, row_bytes): flat row = page * page_size + offset."""
        return pool.view(self.n_kv_heads, -1, pool.shape[-1])

    # ----- sizes --------------------------------------------------------------
    @property
    def n_kv_heads(self) -> int:
        return self.spec.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    def pages_for(self, n_tokens: int) -> int:
        return ceil_div(n_tokens, self.page_size)

    def offset(self, slot: int) -> int:
        self._check_slot(slot)
        return self._packed[slot] + self._win_len[slot]

    def n_packed(self, slot: int) -> int:
        """Tokens of ``slot`` held in pages (the rest, if any, are in the f16 window)."""
        return self._packed[slot]

    def window_len(self, slot: int) -> int:
        return self._win_len[slot]

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.spec.bytes_per_token

    @property
    def window_bytes(self) -> int:
        """One slot's f16 window, K and V."""
        return self.spec.window_bytes(self.f16_window)

    @property
    def nbytes(self) -> int:
        """Bytes in use now: pages held by slots plus the windows of slots holding tokens."""
        return sum(self.slot_nbytes(s) for s in range(self.n_slots))

    @property
    def reserved_bytes(self) -> int:
        """Bytes the pool reserves for every slot's whole context (plus the null page)."""
        return (self.n_pages + 1) * self.page_bytes + self.n_slots * self.window_bytes

    def slot_nbytes(self, slot: int) -> int:
        """Bytes in use for one slot: its pages plus its f16 window if it holds tokens."""
        self._check_slot(slot)
        window = self.window_bytes if self.offset(slot) else 0
        return len(self._pages[slot]) * self.page_bytes + window

    def describe(self) -> dict:
        return {"cache": type(self).__name__, **asdict(self.spec), "page_size": self.page_size,
                "f16_window": self.f16_window, "ctx": self.ctx}

    # ----- writing: public, checked ----------------------------------------------
    def append(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``T`` tokens: k and v are ``(T, n_kv_heads, head_dim)``. Checked: bad values
        (NaN, inf, past the formats' range) are refused and nothing is written."""
        self._check_slot(slot)
        self._check_kv(k, v)
        self._check_room(slot, k.shape[0])
        for name, fmt, t in (("k", self.fmt_k, k), ("v", self.fmt_v, v)):
            check_float_input(t, fmt.name)                              # dtype, NaN/inf: one host sync
            bad = fmt.overflow_flag(t)
            if bool(bad.any()):
                raise ValueError(f"{fmt.name}: {name} holds NaN, infinite or out-of-range values in "
                                 f"{int(bad.sum())} of {t.shape[0]} token(s); refusing to store them")
        self.store(slot, k, v)

    # ----- writing: the hot path (no host sync) ------------------------------------
    def forward(self, batch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                gate: torch.Tensor | None = None) -> torch.Tensor:
        """Store the batch's new K/V and attend for every row: the model's one call per layer.
        q (N, n_heads, D), k/v (N, n_kv_heads, D) -> float32 (N, n_heads, D); with ``gate`` (N,
        n_heads, D), gated attention's (Qwen3.5/3.6), the output times sigmoid(gate) in the gate's
        type, which a decode step's kernel stores in one launch with the attention."""
        return self.backend.forward(self, batch, q, k, v, gate)

    def store(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``T`` tokens to one slot, unchecked (flags overflow on the device)."""
        self._check_room(slot, k.shape[0])
        if self.f16_window == 0:
            self._pack(slot, k, v)                                      # flags as it encodes
            return
        self._flag(k, v, slot)                                          # tokens may stay in the window
        n_win = self._win_len[slot]
        wk, wv = self.win_k[slot], self.win_v[slot]
        all_k = torch.cat([wk[:n_win], k.to(wk.dtype)])
        all_v = torch.cat([wv[:n_win], v.to(wv.dtype)])
        n_out = max(0, all_k.shape[0] - self.f16_window)               # oldest tokens leave the window
        if n_out:
            self._pack(slot, all_k[:n_out], all_v[:n_out])
        keep = all_k.shape[0] - n_out
        wk[:keep], wv[:keep] = all_k[n_out:], all_v[n_out:]
        self._win_len[slot] = keep

    def store_batch(self, batch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append every segment's rows: one encode and one scatter for the whole batch."""
        if batch.prepared:                                              # a DecodeBatch: device work only
            self._scatter(batch.slots, batch.positions, k, v)
            return
        for seg in batch.segments:
            if seg.start_pos != self.offset(seg.slot):
                raise ValueError(f"slot {seg.slot}: the batch writes position {seg.start_pos} but the cache "
                                 f"holds {self.offset(seg.slot)} tokens")
        if self.f16_window:
            for seg in batch.segments:
                self.store(seg.slot, k[seg.begin:seg.end], v[seg.begin:seg.end])
            return
        for seg in batch.segments:
            self._check_room(seg.slot, seg.length)
            self._reserve(seg.slot, seg.start_pos + seg.length)
        self._scatter(batch.slot_ids, batch.positions, k, v)
        for seg in batch.segments:
            self._packed[seg.slot] += seg.length

    # ----- decode steps whose host work is done apart (the compiled path) -------------
    @property
    def static_decode(self) -> bool:
        """Whether a DecodeBatch can write here (the f16 window's moves are host-driven)."""
        return self.f16_window == 0

    def prepare_decode(self, slots: list[int], positions: list[int]) -> None:
        """Host half of a decode step, one token per slot at ``positions`` (checked against the
        lengths once, by ``ModelCache.prepare_decode``): room checked, pages reserved. With an f16
        window (the C step's), the page is the one its oldest token leaves into, if it is full."""
        if self.f16_window and len(set(slots)) < len(slots):
            raise ValueError("with an f16 window a decode step takes one token per slot")
        for slot, pos in zip(slots, positions):
            self._check_room(slot, pos + 1 - self.offset(slot))
            if not self.f16_window:
                self._reserve(slot, pos + 1)
            elif self._win_len[slot] == self.f16_window:
                self._reserve(slot, self._packed[slot] + 1)

    def commit_decode(self, slots: list[int]) -> None:
        """After the step's device work: each slot holds one more token (in the window while it
        has room, else one more in the pages)."""
        for slot in slots:
            if self.f16_window and self._win_len[slot] < self.f16_window:
                self._win_len[slot] += 1
            else:
                self._packed[slot] += 1

    def _flag(self, k, v, slots) -> None:
        self._raise_flags(self.fmt_k.overflow_flag(k) | self.fmt_v.overflow_flag(v), slots)

    def _raise_flags(self, bad: torch.Tensor, slots) -> None:
        """OR per-row flags (T,) into the per-slot ones; ``slots`` is one slot or a (T,) tensor."""
        bad = bad.to(torch.uint8)
        if isinstance(slots, int):
            self.overflow[slots] |= bad.amax()
        else:
            self.overflow.scatter_reduce_(0, slots, bad, reduce="amax")

    def _pack(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        start, n = self._packed[slot], k.shape[0]
        self._reserve(slot, start + n)
        positions = torch.arange(start, start + n, device=self.device)
        self._scatter(torch.full_like(positions, slot), positions, k, v)
        self._packed[slot] = start + n

    def _scatter(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode rows, write token n's at (slots[n], positions[n]) through the block table and
        raise the overflow flags of the slots of tokens that overflow."""
        if self.gpu_append:     # one launch (two if K and V encode apart): rows found, encoded, written, flags raised
            kv_append.append_kv(self.fmt_k, k, self.k_pool, self.fmt_v, v, self.v_pool, self.block_table, slots,
                                positions, self.overflow)
            return
        k_codes, v_codes, bad = self._encode(k, v)
        # Indexed assignment into the pool itself, not a copy into a reshaped view of it: a
        # compiled step turns this into an in-place scatter (a view's index_copy_ into a copy
        # of the whole pool and a copy back).
        page, row = self._page_rows(slots, positions)
        self.k_pool[:, page, row] = k_codes.transpose(0, 1)
        self.v_pool[:, page, row] = v_codes.transpose(0, 1)
        self._raise_flags(bad, slots)

    def _page_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, row in the page) of (slot, position) pairs, read from the block table on the device."""
        return self.block_table[slots, positions // self.page_size].long(), positions % self.page_size

    def _flat_index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat pool rows (page * page_size + row) of (slot, position) pairs."""
        pages, rows = self._page_rows(slots, positions)
        return pages * self.page_size + rows

    def _reserve(self, slot: int, n_tokens: int) -> None:
        """Give ``slot`` pages for its first ``n_tokens`` packed tokens (host bookkeeping;
        new pages are zeroed so a reader past the end sees zeros, not stale bytes)."""
        pages = self._pages[slot]
        while len(pages) * self.page_size < n_tokens:
            page = self._free.pop()
            self.k_pool[:, page].zero_()
            self.v_pool[:, page].zero_()
            self.block_table[slot, len(pages)].fill_(page)      # a Python int set by [] copies from the host and syncs
            pages.append(page)

    # ----- reading ------------------------------------------------------------
    def rows(self, slot: int, start: int = 0, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed K and V rows ``(n, H, row_bytes)`` of tokens [start, start + n) of the pages."""
        self._check_slot(slot)
        n = self._packed[slot] - start if n is None else n
        positions = torch.arange(start, start + n, device=self.device)
        index = self._flat_index(torch.full_like(positions, slot), positions)
        return (self._rows_view(self.k_pool).index_select(1, index).transpose(0, 1),
                self._rows_view(self.v_pool).index_select(1, index).transpose(0, 1))

    def packed_chunks(self, slot: int, chunk_tokens: int):
        """Yield ``(start, k_bytes, v_bytes)`` over the packed history, at most ``chunk_tokens``
        (rounded to whole pages) at a time; each is (n, H, row_bytes)."""
        step = max(1, chunk_tokens // self.page_size) * self.page_size
        for start in range(0, self._packed[slot], step):
            yield (start, *self.rows(slot, start, min(step, self._packed[slot] - start)))

    def window(self, slot: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """``(start, k, v)`` of the f16 window: the newest tokens, not yet packed."""
        n = self._win_len[slot]
        if n == 0:
            empty = torch.zeros(0, self.n_kv_heads, self.head_dim, dtype=torch.float16, device=self.device)
            return self._packed[slot], empty, empty
        return self._packed[slot], self.win_k[slot, :n], self.win_v[slot, :n]

    # ----- overflow -------------------------------------------------------------
    def take_overflow(self) -> torch.Tensor:
        """The per-slot overflow flags (n_slots,) uint8 as they stand, then cleared."""
        flags = self.overflow.clone()
        self.overflow.zero_()
        return flags

    # ----- trimming, state ----------------------------------------------------
    def trim(self, slot: int, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` of ``slot``; whole pages past the end go back to the pool."""
        self._check_slot(slot)
        if not 0 <= n_tokens <= self.offset(slot):
            raise ValueError(f"slot {slot}: cannot trim to {n_tokens} tokens, it holds {self.offset(slot)}")
        if n_tokens >= self._packed[slot]:
            self._win_len[slot] = n_tokens - self._packed[slot]
            return
        self._packed[slot], self._win_len[slot] = n_tokens, 0
        self._release(slot, ceil_div(n_tokens, self.page_size))

    def _release(self, slot: int, keep: int) -> None:
        pages = self._pages[slot]
        if len(pages) > keep:
            self.block_table[slot, keep:len(pages)].fill_(self.null_page)
            self._free.extend(reversed(pages[keep:]))
            del pages[keep:]

    def clear(self, slot: int) -> None:
        self.trim(slot, 0)
        self.overflow[slot].fill_(0)

    def copy_slot(self, src: int, dst: int) -> None:
        """``dst`` becomes a copy of ``src``: pages copied on the device, window and lengths too."""
        self._check_slot(src)
        self.clear(dst)
        n = self._packed[src]
        self._reserve(dst, n)
        src_pages = torch.tensor(self._pages[src], device=self.device)
        dst_pages = torch.tensor(self._pages[dst], device=self.device)
        for pool in (self.k_pool, self.v_pool):
            pool[:, dst_pages] = pool[:, src_pages]
        self._packed[dst], self._win_len[dst] = n, self._win_len[src]
        if self.f16_window:
            self.win_k[dst], self.win_v[dst] = self.win_k[src], self.win_v[src]

    def state(self, slot: int) -> dict[str, torch.Tensor]:
        """Packed rows and window of one slot, exact bytes (for saving)."""
        k, v = self.rows(slot)
        _, wk, wv = self.window(slot)
        return {"k": k.contiguous().cpu(), "v": v.contiguous().cpu(), "win_k": wk.cpu().clone(),
                "win_v": wv.cpu().clone()}

    def check_state(self, slot: int, tensors: dict[str, torch.Tensor], n_tokens: int) -> None:
        """Raise ValueError unless ``load_state`` would accept these tensors (nothing changes)."""
        self._check_slot(slot)
        missing = {"k", "v", "win_k", "win_v"} - set(tensors)
        if missing:
            raise ValueError(f"slot {slot}: saved state lacks {sorted(missing)}")
        k, v, wk, wv = (tensors[name] for name in ("k", "v", "win_k", "win_v"))
        rows = {"k": (self.n_kv_heads, self.spec.k_row_bytes), "v": (self.n_kv_heads, self.spec.v_row_bytes)}
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 3 or tuple(t.shape[1:]) != rows[name] or t.dtype != torch.uint8:
                raise ValueError(f"slot {slot}: saved {name} rows have shape {tuple(t.shape)}, this cache "
                                 f"stores (T, {rows[name][0]}, {rows[name][1]}) uint8")
        if k.shape[0] != v.shape[0] or wk.shape != wv.shape or wk.shape[0] > self.f16_window:
            raise ValueError(f"slot {slot}: saved K/V rows or windows disagree in length")
        if k.shape[0] + wk.shape[0] != n_tokens or n_tokens > self.ctx:
            raise ValueError(f"slot {slot}: saved state holds {k.shape[0] + wk.shape[0]} tokens, "
                             f"expected {n_tokens} within ctx {self.ctx}")

    def load_state(self, slot: int, tensors: dict[str, torch.Tensor], n_tokens: int) -> None:
        self.check_state(slot, tensors, n_tokens)
        self.clear(slot)
        k, v, wk, wv = (tensors[name] for name in ("k", "v", "win_k", "win_v"))
        n = k.shape[0]
        self._reserve(slot, n)
        positions = torch.arange(n, device=self.device)
        index = self._flat_index(torch.full_like(positions, slot), positions)
        self._rows_view(self.k_pool).index_copy_(1, index, k.to(self.device).transpose(0, 1))
        self._rows_view(self.v_pool).index_copy_(1, index, v.to(self.device).transpose(0, 1))
        self._packed[slot] = n
        if wk.shape[0]:
            self.win_k[slot, :wk.shape[0]], self.win_v[slot, :wk.shape[0]] = wk.to(self.device), wv.to(self.device)
        self._win_len[slot] = wk.shape[0]

    # ----- checks -------------------------------------------------------------
    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot!r} does not exist; this cache has slots 0..{self.n_slots - 1}")

    def _check_room(self, slot: int, n_new: int) -> None:
        if self.offset(slot) + n_new > self.ctx:
            raise ValueError(f"slot {slot}: appending {n_new} tokens to {self.offset(slot)} cached would exceed "
                             f"the context size {self.ctx}")

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        want = (self.n_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must have shape (T, n_kv_heads={want[0]}, head_dim={want[1]}), got {got}")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k holds {k.shape[0]} tokens but v holds {v.shape[0]}")
