"""Flag `fast_top_k_top_p`: vLLM-CPU's top-k + top-p filter without sorting the vocabulary.

Qwen3's generation_config.json asks for top_k 20 and top_p 0.95, and `vllm serve` applies them
to every request that does not set its own. vLLM 0.32 on a CPU then sorts every row of logits,
all 151,936 of them, each step (topk_topp_sampler.apply_top_k_top_p_pytorch), which costs more
than a small model's forward on a 2-CPU machine (docs/performance.md).

Top-p after top-k only ever looks at the logits at or above the k-th largest (vLLM keeps every
value tied with the k-th). So this takes the largest max(k) + 64, puts them in
vocabulary order behind -inf padding in a short row whose length is congruent to the
vocabulary's modulo 128 (torch's vectorized softmax then adds the same terms in the same lanes
and order, so the cumulative sums are the same floats), runs vLLM's own function on the short
rows and scatters the result back. The kept tokens and their values are then vLLM's, bit for
bit. Where vLLM's choice rests on the order its unstable sort gives equal logits (a top-p cut
inside a run of equal values), the row goes to vLLM's function unchanged; so does the whole
batch where the window cannot hold every value tied with the k-th, or a row has no top-k, or
its largest logit is NaN or inf.

The candidates come from one streaming pass of our native library where it is built
(csrc/sampling.cpp; torch.topk otherwise). vLLM-CPU then draws the token with
torch.ops._C.fused_gumbel_argmax over the whole row, although all but the kept logits are -inf.
Its noise is a function of the row's seed and the token index alone, so the flag draws on the
kept candidates instead (gumbel_argmax_at) and gets the same token.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger("vllm.pypto")

SLACK = 64  # candidates beyond max(k): room for values tied with the k-th
LANES = 128  # the short row keeps the vocabulary's length modulo this (softmax's lanes x unroll, at most)

Filter = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


@functools.cache
def _native() -> bool:
    """Whether csrc/sampling.cpp's ops run here (built, on a CPU with AVX2)."""
    from .kernels.cpu_backend import native_cpu_status

    return native_cpu_status() is None


def candidates(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` largest logits of each row and their tokens, in vocabulary order. A row with
    NaN, or with fewer than `width` logits above -inf, may come back with NaN among its values
    (the native pass marks it so; topk ranks NaN first)."""
    if _native() and logits.dtype == torch.float32 and logits.stride(1) == 1:
        return tuple(torch.ops.pypto_cpu.top_candidates(logits, width))
    vals, idx = logits.topk(width, dim=-1)
    idx, order = idx.sort(dim=-1)
    return vals.gather(1, order), idx


class _Kept:
    """What the last call of top_k_top_p left in its logits: only `vals` at `idx` above -inf.
    The draw that follows uses it if its logits are that tensor, still holding `vals` at `idx`
    (the engine's inference tensors keep no version counter to tell a change by)."""
    logits: torch.Tensor | None = None
    vals = idx = None


_kept = _Kept()


def top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None,
                full: Filter) -> torch.Tensor | None:
    """full(logits, k, p) (vLLM's filter, which updates logits in place), computed on the top
    candidates of each row; None where it cannot give full's result here (the caller runs full)."""
    _kept.logits = _kept.vals = _kept.idx = None  # kept again below only if this call filters
    if k is None or p is None or logits.dim() != 2:
        return None
    rows, vocab = logits.shape
    k = k.to(torch.long)
    width = int(k.max()) + SLACK
    if int(k.min()) < 1 or width + LANES > vocab:  # a row without top-k has k == vocab
        return None
    vals, idx = candidates(logits, width)
    ranked = vals.sort(dim=-1, descending=True).values
    kth = ranked.gather(1, (k - 1).unsqueeze(1))
    if not (torch.isfinite(ranked[:, :1]).all() and torch.isfinite(kth).all() and (ranked[:, -1:] < kth).all()
            and not vals.isnan().any()):
        return None
    length = width + (vocab - width) % LANES
    short = vals.new_full((rows, length), float("-inf"))
    short[:, length - width:] = vals
    kept = full(short, k, p)[:, length - width:]
    # a masked candidate equal to the smallest kept value: a top-p cut inside a run of ties
    masked = kept == float("-inf")
    smallest = kept.masked_fill(masked, float("inf")).amin(dim=1, keepdim=True)
    redo = ((vals == smallest) & masked).any(dim=1).nonzero().flatten()
    again = logits[redo].clone() if len(redo) else None
    logits.fill_(float("-inf")).scatter_(1, idx, kept)
    if again is not None:
        logits[redo] = full(again, k[redo], p[redo])
    else:
        _kept.logits, _kept.vals, _kept.idx = logits, kept, idx
    return logits


def gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor, full: Callable) -> torch.Tensor:
    """full(logits, seeds) (vLLM-CPU's fused_gumbel_argmax), drawn on the candidates that
    top_k_top_p kept when these are its logits, unchanged; else full itself."""
    vals, idx = _kept.vals, _kept.idx
    mine = _kept.logits is logits and _native() and torch.equal(logits.gather(1, idx), vals)
    _kept.logits = _kept.vals = _kept.idx = None
    return torch.ops.pypto_cpu.gumbel_argmax_at(vals, idx, seeds) if mine else full(logits, seeds)


@functools.cache  # once per process (the quantization config asks for every layer)
def install() -> None:
    """Route vLLM's sampler filter (topk_topp_sampler.apply_top_k_top_p, which the CPU sampler
    calls by module global) through top_k_top_p, and its draw through gumbel_argmax."""
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops import topk_topp_sampler as s

    if not current_platform.is_cpu():  # other platforms sample with their own kernels
        logger.warning("pypto-a8w8: flag fast_top_k_top_p acts on vLLM-CPU's sampler only; it does nothing on %s",
                       type(current_platform).__name__)
        return
    vllm_filter = s.apply_top_k_top_p

    def apply_top_k_top_p(logits, k, p):
        out = top_k_top_p(logits, k, p, s.apply_top_k_top_p_pytorch)
        return vllm_filter(logits, k, p) if out is None else out

    s.apply_top_k_top_p = apply_top_k_top_p
    draw = "vLLM's draw"
    # vLLM-CPU's sampler looks the op up by name at each call (TopKTopPSampler.forward_cpu)
    vllm_draw = getattr(torch.ops._C, "fused_gumbel_argmax", None) if _native() else None
    if vllm_draw is not None:
        def fused_gumbel_argmax(logits, seeds):
            return gumbel_argmax(logits, seeds, vllm_draw)

        fused_gumbel_argmax.__module__ = __name__
        torch.ops._C.fused_gumbel_argmax = fused_gumbel_argmax
        draw = "the Gumbel draw on the kept candidates"
    logger.info("pypto-a8w8: flag fast_top_k_top_p: the sampler's top-k/top-p filter runs on the largest "
                "max(k)+%d logits of a row, then %s", SLACK, draw)
