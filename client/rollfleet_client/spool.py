"""A push's file in the sync sidecar's spool, written over the memory of an earlier push.

The spool is memory (an emptyDir of medium Memory), and fresh pages cost more to get than
the bytes cost to copy: writing 1 GiB took about 1.1 s into new memory and 0.3 s over a
file's existing pages on the 2-core dev box. So the sidecar keeps the file of a superseded
push as ``incoming/.spare.safetensors`` (``SPOOL_SPARE_FILE``), and the next push, written by
the trainer (``rollfleet_client.sync``) or streamed to the sidecar, takes it (a rename:
one taker) and writes over it. Both sides import this module.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import BinaryIO

from rollfleet_client.sync_protocol import SPOOL_SPARE_FILE


def open_over_spare(incoming: Path, target: Path) -> BinaryIO:
    """`target`, new, opened for writing from its start: the spare's memory where one is left. The writer
    calls ``truncate()`` once it has written the whole file (the spare may have been larger)."""
    try:
        (incoming / SPOOL_SPARE_FILE).rename(target)
    except OSError:  # none left (or another push took it first)
        return target.open("wb")
    try:
        return target.open("r+b")
    except PermissionError:  # another user's file, not shared with this one: fresh memory then
        target.unlink()
        return target.open("wb")


def keep_as_spare(incoming: Path, superseded: Path) -> None:
    """Keep the file of a push that is deleted as the spare, unless one is kept already; made writable for
    the trainer, which runs as a user of its own, where this process owns it."""
    spare = incoming / SPOOL_SPARE_FILE
    if spare.exists() or not superseded.is_file():
        return
    with contextlib.suppress(PermissionError):  # the trainer's own file: it can write it already
        superseded.chmod(0o666)
    with contextlib.suppress(OSError):
        superseded.rename(spare)
