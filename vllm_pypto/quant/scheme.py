"""What a compressed-tensors `quantization_config` must say for pypto-a8w8 to serve it.

We implement exactly one scheme (llm-compressor's W8A8 int8 preset): int8 symmetric
per-channel weights, int8 symmetric dynamic per-token activations, no zero points.
Anything else is refused with the field and value named, because serving it with
these kernels would be silently wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


class UnsupportedScheme(ValueError):
    pass


# field -> value we implement (None means "must be absent or null")
_WEIGHTS = {"type": "int", "num_bits": 8, "symmetric": True, "strategy": "channel",
            "group_size": None, "block_structure": None, "dynamic": False, "actorder": None}
_INPUTS = {"type": "int", "num_bits": 8, "symmetric": True, "strategy": "token", "dynamic": True,
           "group_size": None, "block_structure": None}
_WHAT = {"weights": "int8 symmetric per-channel weights", "input_activations":
         "int8 symmetric dynamic per-token activations"}


def _refuse(path: str, value: Any, expected: str) -> UnsupportedScheme:
    return UnsupportedScheme(
        f"quantization_config.{path} = {value!r} is not supported by pypto-a8w8 "
        f"(it implements {expected}). Use a compressed-tensors W8A8 (int8) checkpoint "
        "or a plain bf16 one, which is quantized at load.")


def _check_args(path: str, args: dict | None, spec: dict, what: str) -> None:
    if not isinstance(args, dict):
        raise _refuse(path, args, what)
    for key, want in spec.items():
        got = args.get(key)
        if got is None and want is None:
            continue
        if isinstance(want, str) and isinstance(got, str):
            if got.lower() != want:
                raise _refuse(f"{path}.{key}", got, what)
        elif got != want or type(got) is not type(want):
            raise _refuse(f"{path}.{key}", got, f"{key}={want!r}: {what}")


@dataclass(frozen=True)
class W8A8Scheme:
    """A validated compressed-tensors W8A8 config: which Linear layers are int8."""

    targets: tuple[str, ...]
    ignore: tuple[str, ...]

    @classmethod
    def from_compressed_tensors(cls, cfg: dict[str, Any]) -> "W8A8Scheme":
        method = cfg.get("quant_method")
        if method != "compressed-tensors":
            raise _refuse("quant_method", method, "compressed-tensors W8A8 int8")
        fmt = cfg.get("format")
        if fmt not in ("int-quantized", None):
            raise _refuse("format", fmt, "format 'int-quantized' (int8 weights stored as int8)")
        status = cfg.get("quantization_status")
        if status not in ("compressed", None):
            raise _refuse("quantization_status", status, "'compressed' checkpoints")
        if cfg.get("kv_cache_scheme") is not None:
            raise _refuse("kv_cache_scheme", cfg["kv_cache_scheme"], "a bf16 KV cache (kv_cache_scheme null)")
        groups = cfg.get("config_groups") or {}
        if not groups:
            raise _refuse("config_groups", groups, "at least one W8A8 group")
        targets: list[str] = []
        for gname, group in groups.items():
            path = f"config_groups.{gname}"
            gfmt = group.get("format")
            if gfmt not in (None, "int-quantized"):
                raise _refuse(f"{path}.format", gfmt, "format 'int-quantized'")
            _check_args(f"{path}.weights", group.get("weights"), _WEIGHTS, _WHAT["weights"])
            _check_args(f"{path}.input_activations", group.get("input_activations"), _INPUTS,
                        _WHAT["input_activations"])
            if group.get("output_activations") is not None:
                raise _refuse(f"{path}.output_activations", group["output_activations"],
                              "no output activation quantization")
            targets += list(group.get("targets") or [])
        if not targets:
            raise _refuse("config_groups.*.targets", targets, "targets naming the Linear layers")
        return cls(targets=tuple(targets), ignore=tuple(cfg.get("ignore") or ()))

    def is_quantized(self, name: str) -> bool:
        """Whether the checkpoint module `name` (e.g. model.layers.0.mlp.down_proj) is int8."""
        if any(_matches(pat, name) for pat in self.ignore):
            return False
        # "Linear" targets every linear layer; other targets are names or "re:" patterns.
        return any(t == "Linear" or _matches(t, name) for t in self.targets)


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or name.endswith("." + pattern)
