"""The PyPTO backend for Ascend NPUs (kernels.py, backend.py), the host side shared with the
CPU (paging.py) and the CPU verification (verify.py). Nothing here imports pypto at package
import: CPU serving never loads it."""


def import_pypto():
    """`import pypto`, keeping the root logger's level: pypto 0.2.0 calls
    logging.basicConfig(level=logging.DEBUG) at import (pypto/_controller.py), which turns every
    library's debug messages on in the serving process."""
    import logging

    root = logging.getLogger()
    level = root.level
    import pypto

    root.setLevel(level)
    return pypto
