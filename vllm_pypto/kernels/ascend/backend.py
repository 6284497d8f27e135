"""The PyPTO backend: our kernels (kernels.py) behind the A8W8Backend interface.

`pypto` (VLLM_PYPTO_BACKEND=pypto, or `auto` where torch_npu is installed) launches them on an
Ascend NPU. `pypto-interpret` runs the very same code with RunMode.SIM inside pypto's
pass-verify interpreter on this CPU, with vLLM-CPU as the platform: a correctness tool for the
Ascend serving path, seconds per kernel call, not a CPU serving mode (pypto's licence covers use
with Huawei AI processors; CPU serving uses the native kernels). Never imported on a CPU
serving path.

Kernels are built per static shape; shapes that change every step are padded to buckets (token
rows to a power of two, decode batches to 1/2/4/.../256, block tables to a power of two), so a
serving run builds a bounded number of kernels. `stats` counts calls and builds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import A8W8Backend, logger
from . import paging


def npu_status() -> str | None:
    """None where the PyPTO backend can run on an NPU, else why not."""
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return "torch_npu is not installed (no Ascend NPU stack)"
    if (why := pypto_status()) is not None:
        return why
    if not torch.npu.is_available():
        return "torch_npu finds no NPU"
    return None


def pypto_status() -> str | None:
    from . import import_pypto

    try:
        import_pypto()
    except ImportError as e:
        return f"pypto is not installed ({e}); pip install 'vllm-pypto[ascend]' (or the test extra)"
    return None


@dataclass
class KernelStats:
    calls: int = 0
    decode_steps: int = 0  # decode-only steps whose every layer ran as one PyPTO kernel
    other_steps: int = 0  # prefill and mixed steps (PyPTO linear and MLP kernels, the platform's attention)

    def compiled(self) -> int:
        """Distinct kernels built (one per kernel and static shape; pypto's jit caches each)."""
        from . import kernels

        return sum(f.cache_info().misses for f in (kernels.a8w8_linear, kernels.linear_q, kernels.rmsnorm_quant,
                                                   kernels.mlp_block, kernels.qk_norm_rope,
                                                   kernels.paged_decode_attention, kernels.decode_layer))

    def line(self) -> str:
        return (f"pypto kernels: {self.calls} calls, {self.compiled()} compiled, {self.decode_steps} decode steps "
                f"({self.other_steps} prefill/mixed steps)")


class PyptoBackend(A8W8Backend):
    name = "pypto"
    runs_layers = True  # the model class hands it whole decoder layers (model/pypto_layer.py)

    def __init__(self, interpret: bool = False, run_mode=None):
        """interpret: RunMode.SIM inside pypto's interpreter (verify.Interpreter); run_mode
        overrides the mode for tests that drive the interpreter themselves."""
        from . import import_pypto

        pypto = import_pypto()

        self.interpret = interpret
        if run_mode is None:
            run_mode = pypto.RunMode.SIM if interpret else pypto.RunMode.NPU
        self.run_mode = run_mode
        self.stats = KernelStats()
        self._run = None
        if interpret:
            from .verify import Interpreter

            self._run = Interpreter()
            self.name = "pypto-interpret"
            on_shutdown(lambda: logger.info("pypto-a8w8: %s", self.stats.line()))

    def isa(self) -> str:
        where = ("pypto's interpreter on this CPU (RunMode.SIM: correctness only, seconds per call, not a "
                 "serving mode)" if self.interpret else "Ascend AICore")
        return f"PyPTO kernels (pypto 0.2.0) on {where}: per-token quant, int8 cube GEMM, fp32 dequant"

    def call(self, kernel, *tensors) -> None:
        self.stats.calls += 1
        if self._run is not None:
            self._run(kernel, *tensors)
        else:
            kernel(*tensors)

    def step_done(self, decode: bool) -> None:
        """Called once per forward step by the model (layer 0); logs at 1, 2, 4, ... decode steps."""
        if decode:
            self.stats.decode_steps += 1
            n = self.stats.decode_steps
            if n & (n - 1) == 0:
                logger.info("pypto-a8w8: %s", self.stats.line())
        else:
            self.stats.other_steps += 1

    # ---- the A8W8Backend interface, token rows padded to a power of two ----
    def prepack(self, weight, weight_scale):
        return {"weight": weight.contiguous(), "weight_scale": weight_scale.float().reshape(1, -1).contiguous()}

    def unpacked(self, packed):
        return packed["weight"], packed["weight_scale"].reshape(-1)

    def linear(self, x, packed):
        from . import kernels

        w, ws = packed["weight"], packed["weight_scale"]
        x2 = x.reshape(-1, x.shape[-1])
        M, Mp = x2.shape[0], paging.bucket(max(x2.shape[0], 1))
        out = x2.new_empty(Mp, w.shape[0])
        self.call(kernels.a8w8_linear(Mp, x2.shape[1], w.shape[0], self.run_mode), _pad_rows(x2, Mp), w, ws, out)
        return out[:M].reshape(*x.shape[:-1], w.shape[0])

    def linear_q(self, q, scale, packed):
        from . import kernels

        w, ws = packed["weight"], packed["weight_scale"]
        M, Mp = q.shape[0], paging.bucket(max(q.shape[0], 1))
        out = q.new_empty(Mp, w.shape[0], dtype=torch.bfloat16)
        self.call(kernels.linear_q(Mp, q.shape[1], w.shape[0], self.run_mode), _pad_rows(q, Mp),
                  _pad_rows(scale.reshape(-1, 1).float(), Mp, fill=1.0), w, ws, out)
        return out[:M]

    def rmsnorm_quant(self, x, residual, gamma, eps, deferred=False):
        from . import kernels

        if deferred:
            raise NotImplementedError("deferred_rms is not implemented by the PyPTO kernels")
        x2 = x.reshape(-1, x.shape[-1])
        (M, H), Mp = x2.shape, paging.bucket(max(x2.shape[0], 1))
        res = torch.zeros_like(x2) if residual is None else residual.reshape(x2.shape)
        q, s, h = x2.new_empty(Mp, H, dtype=torch.int8), x2.new_empty(Mp, 1, dtype=torch.float32), x2.new_empty(Mp, H)
        self.call(kernels.rmsnorm_quant(Mp, H, float(eps), self.run_mode), _pad_rows(x2, Mp), _pad_rows(res, Mp),
                  gamma.reshape(1, H).contiguous(), q, s, h)
        return q[:M], s[:M, 0], h[:M]

    def mlp_block(self, x, residual, gamma, gate_up, down, eps):
        """residual add + post-norm + quant, gate_up, SiLU * up + quant, down: one kernel ->
        (out, the new residual)."""
        from . import kernels

        (M, H), Mp = x.shape, paging.bucket(max(x.shape[0], 1))
        I = gate_up["weight"].shape[0] // 2  # noqa: E741
        out, h = x.new_empty(Mp, H), x.new_empty(Mp, H)
        self.call(kernels.mlp_block(Mp, H, I, float(eps), self.run_mode), _pad_rows(x, Mp), _pad_rows(residual, Mp),
                  gamma.reshape(1, H).contiguous(), gate_up["weight"], gate_up["weight_scale"], down["weight"],
                  down["weight_scale"], out, h)
        return out[:M], h[:M]

    def gemm_int32(self, x, amax, packed):
        raise NotImplementedError("tensor-parallel int32 partial sums are not implemented for the PyPTO backend")

    def decode_layer(self, x, residual, weights: dict, kv_cache, batch: paging.DecodeBatch, cos_sin, eps: float,
                     qk_mode: str = "vllm", cache_isa: str | None = None):
        """A whole Qwen3 decoder layer for a decode batch (one token per sequence) as one kernel
        (kernels.decode_layer), reading and writing vLLM's own paged cache in either layout
        (paging.cache_view). weights: gammas `input_layernorm`, `q_norm`, `k_norm`,
        `post_attention_layernorm` and prepacked `qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`.
        cos_sin: fp32 (cos, sin) [B, hd/2] of each token's position, with the rounding qk_mode
        expects (kernels.QK_MODES). cache_isa: vLLM-CPU's attention ISA for its cache (the
        attention layer's `isa`). Returns (out, residual) bf16 [B, H]."""
        from . import kernels

        B, H = x.shape
        qkv, gu = weights["qkv_proj"], weights["gate_up_proj"]
        hd = weights["q_norm"].numel()
        nkv = _kv_heads(kv_cache, hd)
        view = paging.cache_view(kv_cache, nkv, hd, cache_isa)
        nq = qkv["weight"].shape[0] // hd - 2 * nkv
        p = paging.pad_decode(batch, view)
        cache = kernels.PagedCache(view.kind, view.k_rows.shape[0], view.block_size, nkv, hd)
        cos, sin = (p.rows_of(t.float()) for t in cos_sin)
        row = lambda t: t.reshape(1, -1).contiguous()  # noqa: E731
        res = torch.zeros_like(x) if residual is None else residual
        out, h_out = x.new_empty(p.B, H), x.new_empty(p.B, H)
        kernel = kernels.decode_layer(p.B, H, nq, gu["weight"].shape[0] // 2, cache, p.MB, float(eps), qk_mode,
                                      self.run_mode)
        self.call(kernel, p.rows_of(x), p.rows_of(res), row(weights["input_layernorm"]), qkv["weight"],
                  qkv["weight_scale"], row(weights["q_norm"]), row(weights["k_norm"]),
                  cos.repeat_interleave(nq, 0), sin.repeat_interleave(nq, 0), cos.repeat_interleave(nkv, 0),
                  sin.repeat_interleave(nkv, 0), p.rows, p.pages, p.gather_pos, p.seq_lens,
                  torch.arange(p.MB * view.block_size, dtype=torch.int32)[None], view.k_rows, view.v_rows,
                  weights["o_proj"]["weight"], weights["o_proj"]["weight_scale"],
                  row(weights["post_attention_layernorm"]), gu["weight"], gu["weight_scale"],
                  weights["down_proj"]["weight"], weights["down_proj"]["weight_scale"], out, h_out)
        return out[:B], h_out[:B]


def at_exit(fn) -> None:
    """Run fn when the process ends, also in a multiprocessing child (which leaves through
    os._exit, without atexit, after running multiprocessing's own finalizers)."""
    from multiprocessing import util

    util.Finalize(None, fn, exitpriority=10)


def on_shutdown(fn) -> None:
    """Run fn once, when the process ends or is told to stop: under `vllm serve` the model runs in
    a worker process that vLLM stops with a signal and force-kills moments later (vllm 0.32.0,
    shutdown timeout 0), so the line is written from that process's signal handler, which this
    chains to vLLM's own."""
    import signal
    import threading

    done = []

    def once():
        if not done:
            done.append(1)
            fn()

    at_exit(once)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        prev = signal.getsignal(sig)

        def handler(signum, frame, prev=prev):
            once()
            if callable(prev):
                prev(signum, frame)
            elif prev == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

        signal.signal(sig, handler)


def _kv_heads(kv_cache, hd: int) -> int:
    if isinstance(kv_cache, (tuple, list)) or kv_cache.dim() == 5:
        return kv_cache[0].shape[2]
    return kv_cache.shape[1]


def _pad_rows(t: torch.Tensor, M: int, fill: float = 0.0) -> torch.Tensor:
    """t [m, ...] -> [M, ...] contiguous, extra rows `fill` (zero rows quantize to zeros: harmless)."""
    t = t.contiguous()
    if t.shape[0] == M:
        return t
    return torch.cat([t, t.new_full((M - t.shape[0], *t.shape[1:]), fill)], 0)
