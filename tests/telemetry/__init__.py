"""Specs of trainer.telemetry: records, TensorBoard, progress, FLOPs, loggers, profiler."""
