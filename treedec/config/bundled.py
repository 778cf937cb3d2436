"""What ``auto`` means for the bench's two companions of the bundled stack.

``bench.learned_path=auto`` and ``bench.assistant_path=auto`` (the defaults) let
``python -m treedec.bench`` run ``learned`` and ``hf_assisted`` with no extra flag on the bundled
model, and keep both off for a checkpoint of your own, where a tree calibrated for our head or a
2-layer assistant with our tokenizer would be wrong:

* ``learned_path``: the tree shipped for the bundled head, ``treedec/assets/tiny-code-eagle/
  learned_tree.yaml``, when ``draft.path`` is ``tiny-code-eagle``; else null (``learned`` is skipped).
* ``assistant_path``: ``tiny-code-assistant`` (``treedec/assets/tiny-code-assistant/``) when
  ``model.path`` is ``tiny-code``; else null (``hf_assisted`` is skipped).

No torch import here: the option checks run before anything heavy loads.
"""
from __future__ import annotations

from pathlib import Path

from treedec.models.paths import ASSETS

AUTO = "auto"
TARGET, HEAD, ASSISTANT = "tiny-code", "tiny-code-eagle", "tiny-code-assistant"
LEARNED_TREE = ASSETS / HEAD / "learned_tree.yaml"


def is_bundled(value, name: str) -> bool:
    """``value`` names the bundled ``name``: by name, or by the path of its asset directory."""
    if value is None:
        return False
    if str(value) == name:
        return True
    try:
        return Path(str(value)).expanduser().resolve() == (ASSETS / name).resolve()
    except OSError:
        return False


def learned_path(value, draft_path) -> tuple[str | None, str]:
    """``bench.learned_path`` resolved -> (a shape file or None, why: logged and recorded when None)."""
    if value is None:
        return None, "bench.learned_path is null (point it at a learned_tree.yaml from `python -m treedec.calibrate`)"
    if str(value) != AUTO:
        return str(value), f"bench.learned_path={value}"
    if not is_bundled(draft_path, HEAD):
        return None, (f"bench.learned_path=auto ships a tree only for the bundled head {HEAD}, not draft.path="
                      f"{draft_path}; calibrate one (`python -m treedec.calibrate ...`) and pass bench.learned_path=")
    if not LEARNED_TREE.is_file():
        return None, (f"bench.learned_path=auto: the shipped tree {LEARNED_TREE} is missing (retraining the head with "
                      f"export_dir=bundled replaces the directory: recalibrate with `python -m treedec.calibrate "
                      f"num_threads=2 hydra.run.dir=outputs/calibrate/tiny-code` and copy its learned_tree.yaml "
                      f"there, or restore it from git)")
    return str(LEARNED_TREE), f"bench.learned_path=auto: {LEARNED_TREE} (shipped for {HEAD})"


def assistant_path(value, model_path) -> tuple[str | None, str]:
    """``bench.assistant_path`` resolved -> (a bundled name or a directory, or None, why)."""
    if value is None:
        return None, "bench.assistant_path is null (a smaller HF model with the same tokenizer)"
    if str(value) != AUTO:
        return str(value), f"bench.assistant_path={value}"
    if not is_bundled(model_path, TARGET):
        return None, (f"bench.assistant_path=auto ships an assistant only for the bundled {TARGET}, not model.path="
                      f"{model_path}; pass bench.assistant_path=<a smaller HF model with the same tokenizer>")
    return ASSISTANT, f"bench.assistant_path=auto: {ASSISTANT} (the assistant shipped for {TARGET})"


__all__ = ["ASSISTANT", "AUTO", "HEAD", "LEARNED_TREE", "TARGET", "assistant_path", "is_bundled",
           "learned_path"]
