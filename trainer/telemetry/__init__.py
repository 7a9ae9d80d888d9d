"""What a run reports while it trains, and the probes and counters behind the reports.

* :mod:`trainer.telemetry.service` — the telemetry service: per-window records, alerts,
  the set-up report; fans records out to its sinks.
* :mod:`trainer.telemetry.progress` — the console (bar, plain lines or nothing).
* :mod:`trainer.telemetry.summaries` — TensorBoard event files and ``metrics.jsonl``.
* :mod:`trainer.telemetry.object_append` — appending to them in a bucket by compose.
* :mod:`trainer.telemetry.loggers` — experiment loggers beyond the run's own files
  (MLflow): a new logger is a new sink here.
* :mod:`trainer.telemetry.system_stats` — host and device memory and utilisation.
* :mod:`trainer.telemetry.probes` — short timing probes of the input and the compute.
* :mod:`trainer.telemetry.input_wait` — when to probe, and what the latest probe says
  about a window (the input-wait fraction).
* :mod:`trainer.telemetry.flops` — model FLOPs per example, TFLOPS, MFU/HFU.
* :mod:`trainer.telemetry.profiler` — TensorFlow profiler windows.
* :mod:`trainer.telemetry.goodput` — where the run's time went, over its restarts;
  :mod:`trainer.telemetry.goodput_record` — the workdir's record of it.
"""

__all__ = ["alerts", "flops", "goodput", "goodput_record", "loggers", "object_append", "probes",
           "profiler", "progress", "service", "summaries", "system_stats"]
