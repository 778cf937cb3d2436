"""Test-wide setup: the Triton interpreter must be on before any kernel is defined."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny models are dominated by dispatch overhead, and a second thread only adds contention
# when the machine is shared (e.g. with a training job): keep the suite single-threaded.
torch.set_num_threads(1)
