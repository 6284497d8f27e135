"""The experimental-flag registry: every fast path or upstream-compatibility switch
that changes what runs is a named flag here, default off, with its status and its
measured effect. Set with VLLM_PYPTO_FLAGS=a,b or vLLM's
`--additional-config '{"pypto_flags": ["a"]}'`. Unknown names are errors.

    python -m vllm_pypto.flags      # prints the table
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

ENV = "VLLM_PYPTO_FLAGS"
CONFIG_KEY = "pypto_flags"
STATUSES = ("experimental", "validated", "rejected")


@dataclass(frozen=True)
class Flag:
    name: str
    description: str
    status: str
    tpot_effect: str  # measured, with the shape it was measured on; "not measured" until it is


FLAGS: dict[str, Flag] = {f.name: f for f in (
    Flag("bf16_down_proj",
         "Run mlp.down_proj in bf16 (int8 checkpoints are dequantized at load), as the upstream did",
         "experimental", "not measured"),
)}
assert all(f.status in STATUSES for f in FLAGS.values())


def parse(names: Iterable[str] | str | None) -> frozenset[str]:
    if names is None:
        return frozenset()
    if isinstance(names, str):
        names = names.split(",")
    chosen = frozenset(n.strip() for n in names if n and n.strip())
    unknown = sorted(chosen - FLAGS.keys())
    if unknown:
        raise ValueError(f"unknown pypto-a8w8 flag(s) {unknown}; valid flags: {', '.join(sorted(FLAGS))}")
    return chosen


def active(additional_config: dict | None = None) -> frozenset[str]:
    """Flags from the environment and from vLLM's additional_config, validated."""
    from_config = (additional_config or {}).get(CONFIG_KEY)
    if from_config is not None and not isinstance(from_config, (list, tuple, str)):
        raise ValueError(f"additional_config[{CONFIG_KEY!r}] must be a list of flag names, got {from_config!r}")
    return parse(os.environ.get(ENV)) | parse(from_config)


def table() -> str:
    rows = ["| flag | status | TPOT effect | what it does |", "| --- | --- | --- | --- |"]
    rows += [f"| `{f.name}` | {f.status} | {f.tpot_effect} | {f.description} |" for f in FLAGS.values()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
