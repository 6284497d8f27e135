"""An independent golden Qwen3 A8W8 forward, written from the spec (shared seed-notes,
"Numerics") and sharing no code with vllm_pypto: it reads safetensors itself,
quantizes with its own code and multiplies int8 values exactly (as float64). Slow and simple on purpose:
no KV cache, the whole sequence is recomputed for every new token.

Rounding points follow the spec: hidden state carried in bf16, residual adds and
norms in fp32, Q/K norm + RoPE in fp32, attention on bf16 operands with fp32
scores and softmax and bf16 probabilities, logits from a bf16 lm_head (as vLLM
returns them: bf16 values widened to fp32), or an A8W8 one (int8_head, flag int8_lm_head).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

BF16 = torch.bfloat16


def _load(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for fn in sorted(os.listdir(folder)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(folder, fn), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: amax floor 1e-4, x*(127/amax), half-to-even, clamp 127."""
    x = x.float()
    amax = torch.maximum(x.abs().max(dim=1, keepdim=True).values, torch.tensor(1e-4))
    inv = torch.full_like(amax, 127.0) / amax  # IEEE division (a python scalar / tensor is not)
    q = torch.clamp(torch.round(x * inv), -127, 127)
    return q.to(torch.int64), (amax / 127.0)[:, 0]


class GoldenQwen3:
    def __init__(self, folder: str, a8w8: bool = True, bf16_down: bool = False, int8_head: bool = False):
        with open(os.path.join(folder, "config.json")) as f:
            self.cfg = json.load(f)
        self.t = _load(folder)
        self.a8w8 = a8w8
        self.w: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for name in [k[: -len(".weight")] for k in self.t if k.endswith("_proj.weight")]:
            w = self.t[f"{name}.weight"]
            if bf16_down and name.endswith("mlp.down_proj"):  # the upstream choice: dequantized bf16
                s = self.t.get(f"{name}.weight_scale")
                self.w[name] = ((w.float() * s.float().reshape(-1, 1)).to(BF16) if s is not None else w.to(BF16), None)
            elif w.dtype == torch.int8:
                assert a8w8, "an int8 checkpoint only has an A8W8 golden"
                self.w[name] = (w.to(torch.float64), self.t[f"{name}.weight_scale"].float().flatten())
            elif a8w8:
                amax = w.float().abs().max(dim=1).values.clamp(min=1e-4)
                scale = amax / 127.0
                self.w[name] = (torch.clamp(torch.round(w.float() / scale[:, None]), -127, 127).to(torch.float64), scale)
            else:
                self.w[name] = (w.to(BF16), None)
        c = self.cfg
        self.hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        self.nh, self.nkv, self.eps = c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
        self.head = self.t["model.embed_tokens.weight"] if c["tie_word_embeddings"] else self.t["lm_head.weight"]
        if int8_head:  # flag int8_lm_head: the head quantized by the linears' rule
            amax = self.head.float().abs().max(dim=1).values.clamp(min=1e-4)
            scale = amax / 127.0
            self.w["lm_head"] = (torch.clamp(torch.round(self.head.float() / scale[:, None]), -127, 127).to(torch.float64),
                                 scale)

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w, ws = self.w[name]
        if ws is None:
            return (x.float() @ w.float().T).to(BF16)
        q, xs = quant_rows(x)
        # exact: every sum of int8 products is an integer far below 2**53; float64, because an
        # int64 matmul has no BLAS (the 151936-row int8 head took minutes a prompt in int64)
        acc = q.double() @ w.T  # w: int8 values held as float64
        return (acc.float() * ws[None, :] * xs[:, None]).to(BF16)

    def rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.t[name].float()

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        half = self.hd // 2
        inv = 1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        ang = pos.float()[:, None] * inv[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """fp32 logits (bf16-valued) for every position of `ids`."""
        T = len(ids)
        pos = torch.arange(T)
        h = self.t["model.embed_tokens.weight"][torch.tensor(ids)].to(BF16)
        mask = torch.full((T, T), float("-inf")).triu(1)
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{i}"
            x = self.rms(h, f"{p}.input_layernorm.weight").to(BF16)
            q = self.linear(x, f"{p}.self_attn.q_proj").view(T, self.nh, self.hd)
            k = self.linear(x, f"{p}.self_attn.k_proj").view(T, self.nkv, self.hd)
            v = self.linear(x, f"{p}.self_attn.v_proj").view(T, self.nkv, self.hd)
            q = self.rope(self.rms(q, f"{p}.self_attn.q_norm.weight"), pos).to(BF16)
            k = self.rope(self.rms(k, f"{p}.self_attn.k_norm.weight"), pos).to(BF16)
            rep = self.nh // self.nkv
            kf = k.float().repeat_interleave(rep, dim=1)
            vf = v.float().repeat_interleave(rep, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q.float(), kf) / (self.hd ** 0.5) + mask
            probs = torch.softmax(scores, dim=-1).to(BF16).float()
            attn = torch.einsum("hqk,khd->qhd", probs, vf).reshape(T, self.nh * self.hd).to(BF16)
            h = (h.float() + self.linear(attn, f"{p}.self_attn.o_proj").float()).to(BF16)
            x = self.rms(h, f"{p}.post_attention_layernorm.weight").to(BF16)
            g = self.linear(x, f"{p}.mlp.gate_proj").float()
            u = self.linear(x, f"{p}.mlp.up_proj").float()
            h = (h.float() + self.linear((torch.nn.functional.silu(g) * u).to(BF16), f"{p}.mlp.down_proj").float()).to(BF16)
        x = self.rms(h, "model.norm.weight").to(BF16)
        if "lm_head" in self.w:
            return self.linear(x, "lm_head").float()
        return (x.float() @ self.head.float().T).to(BF16).float()

    def greedy(self, prompt_ids: list[int], n: int) -> list[int]:
        ids = list(prompt_ids)
        for _ in range(n):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(prompt_ids):]

    def teacher_forced(self, prompt_ids: list[int], out_ids: list[int]) -> dict:
        """Score a given continuation: per step, the golden's argmax, its top-2 margin,
        and its log-probability of the given token."""
        lg = self.logits(list(prompt_ids) + list(out_ids)[:-1])[len(prompt_ids) - 1:]
        lp = torch.log_softmax(lg, dim=-1)
        top2 = lg.topk(2, dim=-1).values
        return {"argmax": lg.argmax(-1).tolist(), "margin": (top2[:, 0] - top2[:, 1]).tolist(),
                "logprob": lp.gather(1, torch.tensor(out_ids)[:, None])[:, 0].tolist()}
