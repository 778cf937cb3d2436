"""``python -m tests.training._late_sigterm <train overrides>``: ``python -m treedec.train``, with a SIGTERM sent to
itself the moment ``metrics.json`` is written (the export was written before it): a signal that lands on a job
whose work is done."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import treedec.atomic as atomic

_write_json = atomic.write_json


def _write_then_sigterm(path, *args, **kwargs):
    out = _write_json(path, *args, **kwargs)
    if Path(path).name == "metrics.json":
        os.kill(os.getpid(), signal.SIGTERM)
    return out


atomic.write_json = _write_then_sigterm

if __name__ == "__main__":
    from treedec.train import main

    main()
