"""Stand-ins for a preemption (block a fresh run at a given step until killed or SIGTERMed) and for a crash."""
from __future__ import annotations

import time
from pathlib import Path

import lightning as L


class PauseOnce(L.Callback):
    """At ``global_step >= at`` write ``marker`` and sleep (the test then SIGKILLs the process).

    Runs only while ``marker`` does not exist, so re-running the very same command (same callback)
    trains through. Lightning calls checkpoint callbacks after this one, so the checkpoints of the
    steps before ``at`` are on disk when the marker appears.
    """

    def __init__(self, at: int, marker: str, seconds: float = 300.0):
        self.at, self.marker, self.seconds = int(at), Path(marker), float(seconds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.at and not self.marker.exists():
            self.marker.write_text(str(trainer.global_step))
            time.sleep(self.seconds)


class CrashOnce(L.Callback):
    """At ``global_step >= at`` write ``marker`` and raise, as a job that crashes (once: the re-run trains through)."""

    def __init__(self, at: int, marker: str):
        self.at, self.marker = int(at), Path(marker)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.at and not self.marker.exists():
            self.marker.write_text(str(trainer.global_step))
            raise RuntimeError(f"simulated crash at step {trainer.global_step}")


class WaitForSigterm(L.Callback):
    """At ``global_step >= at`` write ``marker`` and wait (at most ``seconds``) until Lightning has seen a SIGTERM,
    so that the test's signal lands at a known step. Once: a re-run with the marker there trains through."""

    def __init__(self, at: int, marker: str, seconds: float = 120.0):
        self.at, self.marker, self.seconds = int(at), Path(marker), float(seconds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.at and not self.marker.exists():
            self.marker.write_text(str(trainer.global_step))
            deadline = time.time() + self.seconds
            while not trainer.received_sigterm and time.time() < deadline:
                time.sleep(0.02)


class SigtermOnFinalValidation(L.Callback):
    """SIGTERM this process when the validation after training ends (``trainer.validate``, after ``fit``): a signal
    that lands after the last step, before the export and metrics.json are written."""

    def on_validation_end(self, trainer, pl_module) -> None:
        import os
        import signal

        if trainer.state.fn == "validate":
            os.kill(os.getpid(), signal.SIGTERM)
