"""Where every benchmark writes: results/<date>-<machine>-<tag>.{json,md}."""

from __future__ import annotations

import json
import os
import platform
import time


def write(out: str, tag: str, report: dict, md: str) -> str:
    """Writes the report as JSON and its markdown table; returns the path stem."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"{time.strftime('%Y-%m-%d')}-{platform.node() or 'machine'}-{tag}")
    with open(stem + ".json", "w") as f:
        json.dump(report, f, ensure_ascii=False, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(md + "\n")
    return stem


def pyplot():
    """matplotlib's pyplot drawing to files, or None where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
