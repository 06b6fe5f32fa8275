"""``python -m fsdpcheck ARGS`` whose checkpoint reads fail as a disk would (EIO).

Used as one process of a torchrun launch (tests/dist/offline/test_offline_dist.py): a read failure
on that process alone, behind the real command line.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from fsdpcheck.sources import prefetch


def _broken(source: Any, regions: Any, *args: Any) -> Any:
    raise OSError(errno.EIO, os.strerror(errno.EIO), f"{source.description} (data)")


if __name__ == "__main__":
    prefetch._read = _broken
    from fsdpcheck.cli import run

    run()
