"""`python -m vllm_pypto info`: the environment report (vllm_pypto/info.py)."""

import sys

if __name__ == "__main__":
    if sys.argv[1:] != ["info"]:
        sys.exit("usage: python -m vllm_pypto info")
    from .info import main

    main()
