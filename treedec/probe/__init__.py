"""What ``python -m treedec.calibrate`` measures and fits: a probe run's acceptance by depth and sibling rank and
its edges' outcomes (:mod:`~treedec.probe.acceptance`), this machine's verify and draft timings
(:mod:`~treedec.probe.timing`), the learned tree they give (:mod:`~treedec.probe.learn`), and the files written
from them (:mod:`~treedec.probe.outputs`, the reliability diagram: :mod:`~treedec.probe.plot`).

It sits above :mod:`treedec.decoding` (a probe is a speculative run) and :mod:`treedec.tree` (the Sequoia DP and the
calibration maps it feeds).
"""
