"""Specs of trainer.doctor: verdicts, the report and the measurements."""
