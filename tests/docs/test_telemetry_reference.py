"""docs/telemetry.md names every key of a metrics.jsonl record, so a new key cannot go
undocumented (the keys are :data:`trainer.telemetry.service.TRAIN_KEYS` / ``EVAL_KEYS``,
and the goodput record's :data:`trainer.telemetry.goodput_record.KEYS`)."""

from __future__ import annotations

from tests.support.helpers import REPO
from trainer.telemetry import goodput_record, service


def test_every_metrics_jsonl_key_is_documented():
    text = (REPO / "docs" / "telemetry.md").read_text()
    keys = {*service.TRAIN_KEYS, *service.EVAL_KEYS, *goodput_record.KEYS}
    missing = sorted(k for k in keys if f"`{k}`" not in text)
    assert not missing, f"docs/telemetry.md's metrics.jsonl table lacks {missing}"
