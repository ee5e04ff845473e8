"""A trainer process that starts a collective push and stalls halfway through its broadcast.

``python -m tests.collective.stalling_trainer SIDECAR_URL WEIGHTS_DIR VERSION``: prints
``stalled`` once half the tensors are sent, then waits to be killed, as a trainer that
dies or loses its network in the middle of a push.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from rollfleet_client.collective import CollectivePusher, state_dict_source
from rollfleet_client.sync import SyncClient


def main(sidecar_url: str, weights_dir: str, version: str) -> None:
    tensors = load_file(str(Path(weights_dir) / "model.safetensors"))
    source = state_dict_source(tensors)
    whole = type(source).__iter__

    def stalling(self: Any) -> Iterator[tuple[str, Any]]:
        for i, item in enumerate(whole(self)):
            if i == len(tensors) // 2:
                print("stalled", flush=True)
                threading.Event().wait()  # until killed
            yield item

    type(source).__iter__ = stalling  # type: ignore[method-assign]
    with CollectivePusher(source, backend="gloo", sync=SyncClient(sidecar_url), address="127.0.0.1") as pusher:
        pusher.push(version)


if __name__ == "__main__":
    main(*sys.argv[1:])
