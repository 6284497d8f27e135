"""The PyPTO decode path's host side (vllm_pypto/kernels/ascend/paging.py), which needs no pypto:
vLLM-CPU's cache interiors against vLLM's own cache write, the indices the kernels gather and
scatter through for both platforms' layouts, the metadata it reads, and the bucketing that
bounds how many kernels a serving run builds."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from vllm_pypto.kernels.ascend import paging as P

HAS_AMX = torch.cpu._is_amx_tile_supported()


def vllm_cpu_write(isa: str, nb: int, nkv: int, bs: int, hd: int, slots: torch.Tensor, g: torch.Generator):
    """A vLLM-CPU layer cache with K/V of len(slots) tokens written by vLLM's own op."""
    from vllm import _custom_ops as ops

    if isa == "amx":
        torch.cpu._init_amx()  # the tile permission vLLM-CPU's worker asks for
    kv = torch.zeros(nb, nkv, bs, 2 * hd, dtype=torch.bfloat16)
    kc, vc = kv.view(nb, nkv, 2 * bs, hd).chunk(2, dim=2)  # cpu_attn.py's own view
    k, v = (torch.randn(len(slots), nkv, hd, generator=g).to(torch.bfloat16) for _ in range(2))
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    return kv, k, v


ISAS = [pytest.param("amx", marks=pytest.mark.skipif(not HAS_AMX, reason="vLLM-CPU's AMX path needs AMX")),
        "vec", "vec16"]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bs", [32, 128])
def test_cpu_interiors_are_where_vllm_writes(isa, bs):
    """Every element of every token written by vLLM-CPU's cpu_attn_reshape_and_cache is where
    paging.INTERIORS says (K and V, every head and dimension); a vLLM upgrade that repacks them fails here."""
    if isa == "vec16" and bs != 32:
        pytest.skip("vLLM-CPU takes vec16 only for head sizes that are not multiples of 32")
    g = torch.Generator().manual_seed(bs)
    nb, nkv, hd = 5, 2, 128
    slots = torch.randperm(nb * bs, generator=g)[:40]
    kv, k, v = vllm_cpu_write(isa, nb, nkv, bs, hd, slots, g)
    view = P.cache_view(kv, nkv, hd, isa)
    off = view.offsets(slots // bs, slots % bs)  # [T, nkv, 2, hd]
    flat = view.k_rows[:, 0]
    assert torch.equal(flat[off[:, :, 0]], k) and torch.equal(flat[off[:, :, 1]], v)
    assert view.k_rows.data_ptr() == kv.data_ptr(), "the kernels must see vLLM's tensor, not a copy"


def _gather(rows: torch.Tensor, table: torch.Tensor, idx: torch.Tensor, bs: int) -> torch.Tensor:
    """pypto.experimental.gather_in_ub's documented semantics: row = table[i // bs] * bs + i % bs."""
    return rows[table[idx // bs].long() * bs + idx % bs]


@pytest.mark.parametrize("isa", ["vec", pytest.param("amx", marks=ISAS[0].marks)])
def test_flat_pages_gather_each_sequences_keys_and_values(isa):
    """What the kernel gathers for sequence b, head h through the flat pages is its K and V in
    position order, over scrambled block tables; the write rows land where vLLM reads."""
    g = torch.Generator().manual_seed(1)
    nb, nkv, bs, hd, lens = 9, 2, 32, 64, [40, 3, 64]
    B, MB = len(lens), 2
    tables = torch.randperm(nb - 1, generator=g)[: B * MB].view(B, MB).int() + 1
    pos = [torch.arange(n) for n in lens]
    slots = torch.cat([tables[b, p // bs].long() * bs + p % bs for b, p in enumerate(pos)])
    kv, k, v = vllm_cpu_write(isa, nb, nkv, bs, hd, slots, g)
    view = P.cache_view(kv, nkv, hd, isa)
    last = torch.tensor([int(s[-1]) for s in torch.split(slots, lens)])
    rows, pages, gpos = P.kernel_indices(view, last, tables)
    assert pages.shape == (2 * B * nkv, MB * bs * hd) and gpos.shape == (1, MB * bs * hd)
    flat, start = view.k_rows, 0
    for b, n in enumerate(lens):
        for h in range(nkv):
            for j, ref in enumerate((k, v)):
                got = _gather(flat, pages[(b * nkv + h) * 2 + j], gpos[0], 1).view(MB * bs, hd)[:n]
                assert torch.equal(got, ref[start:start + n, h]), (b, h, j)
        start += n
    # the write rows: each new token's K then V, every head, in (token, head, K/V, dim) order
    assert rows.shape == (2 * B * nkv * hd, 1)
    ends = torch.tensor(lens).cumsum(0) - 1
    new = torch.stack([k[ends], v[ends]], 2).reshape(-1)  # [B, nkv, 2, hd]
    assert torch.equal(flat[rows[:, 0], 0], new)


def test_paired_layout_is_rows_per_slot():
    """vLLM-Ascend's (k, v) pair [blocks, block_size, nkv, hd]: rows are slots, pages are the block
    tables, and a page gather returns each position's row of every head."""
    g = torch.Generator().manual_seed(2)
    nb, bs, nkv, hd = 6, 4, 2, 8
    k, v = (torch.randn(nb, bs, nkv, hd, generator=g).to(torch.bfloat16) for _ in range(2))
    view = P.cache_view((k, v), nkv, hd)
    assert view.kind == "paired" and view.k_rows.shape == (nb * bs, nkv * hd)
    assert view.k_rows.data_ptr() == k.data_ptr() and view.v_rows.data_ptr() == v.data_ptr()
    assert P.cache_view(torch.stack([k, v]), nkv, hd).kind == "paired"
    tables = torch.tensor([[3, 1], [5, 0]], dtype=torch.int32)
    rows, pages, gpos = P.kernel_indices(view, torch.tensor([3 * bs + 2, 5 * bs]), tables)
    assert rows[:, 0].tolist() == [3 * bs + 2, 5 * bs] and torch.equal(pages, tables)
    got = _gather(view.k_rows, pages[0], gpos[0], bs)
    assert torch.equal(got.view(2, bs, nkv, hd), k[[3, 1]])


def test_unknown_layouts_are_refused():
    kv = torch.zeros(4, 2, 32, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'neon' attention packs"):
        P.cache_view(kv, 2, 128, "neon")
    with pytest.raises(ValueError, match="expected vLLM-CPU's"):
        P.cache_view(torch.zeros(4, 2, 32, 128), 2, 128, "vec")


def test_decode_batch_from_vllm_cpu_metadata():
    """vLLM-CPU's own metadata class: a decode-only step is one query token per sequence."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    def meta(qlens, seq_lens):
        qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
        return CPUAttentionMetadata(num_actual_tokens=sum(qlens), max_query_len=max(qlens), query_start_loc=qsl,
                                    max_seq_len=max(seq_lens), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                                    block_table=torch.arange(12, dtype=torch.int32).view(3, 4),
                                    slot_mapping=torch.arange(sum(qlens)) + 100, scheduler_metadata=None)

    batch = P.decode_batch(meta([1, 1, 1], [5, 9, 200]))
    assert batch.size == 3 and batch.slots.tolist() == [100, 101, 102] and batch.block_table.shape == (3, 4)
    assert batch.seq_lens.tolist() == [5, 9, 200]
    assert P.decode_batch(meta([1, 4, 1], [5, 9, 200])) is None  # mixed prefill + decode
    assert P.decode_batch(None) is None  # warm-up pass


@dataclass
class _AscendState:  # vllm_ascend.attention.attention_v1.AscendAttentionState, which cannot import here
    name: str


def test_decode_batch_from_ascend_fields():
    """AscendMetadata's fields (vllm-ascend 0.23.0.post1, attention/attention_v1.py): block_tables,
    slot_mapping, seq_lens, attn_state; only DecodeOnly runs the decode kernel."""
    fields = dict(block_tables=torch.zeros(2, 3, dtype=torch.int32), slot_mapping=torch.tensor([7, 300]),
                  seq_lens=torch.tensor([8, 45], dtype=torch.int32))
    meta = type("AscendMetadata", (), {**fields, "attn_state": _AscendState("DecodeOnly")})()
    assert P.decode_batch(meta).slots.tolist() == [7, 300]
    meta.attn_state = _AscendState("ChunkedPrefill")
    assert P.decode_batch(meta) is None


def test_buckets_bound_the_kernels_a_serving_run_builds():
    """Batch 1..256 and contexts up to 32768 tokens at block size 128 map onto 9 x 9 decode shapes;
    padding rows repeat row 0 and every table is cut or padded to its bucket."""
    view = P.CacheView("paired", torch.zeros(1), torch.zeros(1), 128, 2, 8)
    shapes = set()
    for n in range(1, 257, 7):
        for ctx in (1, 127, 128, 129, 1000, 4096, 32768):
            batch = P.DecodeBatch(torch.arange(n), torch.ones(n, 300, dtype=torch.int32),
                                  torch.full((n,), ctx, dtype=torch.int32))
            p = P.pad_decode(batch, view)
            assert p.B >= n and p.MB * 128 >= ctx and p.pages.shape == (p.B, p.MB)
            assert p.rows[n:, 0].eq(p.rows[0, 0]).all()
            shapes.add((p.B, p.MB))
    assert len(shapes) <= 9 * 9
    assert {b for b, _ in shapes} <= set(P.BATCH_BUCKETS)
    assert [P.bucket(n) for n in (1, 2, 3, 5, 9, 129)] == [1, 2, 4, 8, 16, 256]
