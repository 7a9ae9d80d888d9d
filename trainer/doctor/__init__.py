"""The performance doctor: why is this run as fast as it is (``python -m trainer.doctor``).

* :mod:`trainer.doctor.cli` — the command line, free of TensorFlow (flags, sections,
  the config checked first).
* :mod:`trainer.doctor.measure` — the measurements (TensorFlow): baseline, input,
  compute, XLA, batch search, per-replica scaling.
* :mod:`trainer.doctor.layer_profile` — each top-level layer timed alone.
* :mod:`trainer.doctor.report` — the verdict and the table, from the numbers (no
  TensorFlow).
"""

__all__ = ["cli", "layer_profile", "measure", "phases", "plan_trials", "report",
           "thread_pools"]
