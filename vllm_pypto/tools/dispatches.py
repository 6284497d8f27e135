"""Kernel dispatches per decode step: the fan-out that made the upstream slow (~38.7k
device tasks per step at first).

Counts every operator call the model's forward makes through PyTorch's dispatcher (aten
ops, vLLM's custom ops, ours) with a TorchDispatchMode, in an eager engine (no
torch.compile, which would fuse and hide them) at batch 1. A custom op counts once
whatever it does inside. View ops (reshape, split, ...) launch nothing and are counted
apart.

    python -m vllm_pypto.tools.dispatches --model DIR [--quantization pypto-a8w8] [--flags a,b]

Needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (the counter lives in the engine's process); the
command line sets it.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.views = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "is_view", False):
            self.views += 1
        else:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _counting(fn, log: list, layer: bool):
    def wrapped(*args, **kwargs):
        mode = _Count()
        with mode:
            out = fn(*args, **kwargs)
        # positions: a decoder layer's first argument, the model's second
        tokens = (args[0] if layer else kwargs.get("positions", args[1] if len(args) > 1 else None)).shape[-1]
        log.append({"tokens": int(tokens), "ops": sum(mode.ops.values()), "views": mode.views,
                    "by_op": dict(mode.ops)})
        return out
    return wrapped


def _install(model):
    """Wrap the decoder stack's forward and the first layer's forward with counters."""
    model._pypto_count = {"model": [], "layer0": []}
    inner = model.model
    inner.forward = _counting(inner.forward, model._pypto_count["model"], layer=False)
    layer = inner.layers[inner.start_layer]
    layer.forward = _counting(layer.forward, model._pypto_count["layer0"], layer=True)
    return type(model).__name__, type(layer).__name__, inner.end_layer - inner.start_layer


def count(model: str, quantization: str | None = None, extra_env: dict | None = None, steps: int = 6) -> dict:
    from vllm import LLM, SamplingParams

    os.environ.update(extra_env or {})
    llm = LLM(model, quantization=quantization, dtype="bfloat16", max_model_len=256, enforce_eager=True,
              seed=0, enable_prefix_caching=False)
    cls, layer_cls, layers = llm.apply_model(_install)[0]
    llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    logs = llm.apply_model(lambda m: m._pypto_count)[0]
    decode = [e for e in logs["model"] if e["tokens"] == 1]
    layer = [e for e in logs["layer0"] if e["tokens"] == 1]
    if not decode or not layer:
        raise RuntimeError(f"no batch-1 decode step was seen ({len(logs['model'])} forward calls)")
    step, one = decode[-1], layer[-1]
    return {"model_class": cls, "layer_class": layer_cls, "layers": layers,
            "per_step": step["ops"], "views_per_step": step["views"],
            "per_layer": one["ops"], "views_per_layer": one["views"], "layer_ops": one["by_op"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--flags", default=None, help="VLLM_PYPTO_FLAGS for this run")
    ap.add_argument("--stock-model-class", action="store_true", help="VLLM_PYPTO_MODEL=vllm")
    ap.add_argument("--out", default="-")
    a = ap.parse_args(argv)
    env = {"VLLM_PYPTO_FLAGS": a.flags or ""}
    if a.stock_model_class:
        env["VLLM_PYPTO_MODEL"] = "vllm"
    res = count(a.model, a.quantization, env)
    text = json.dumps(res, indent=1)
    if a.out == "-":
        print(text)
    else:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
