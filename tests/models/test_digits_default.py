"""The embedded-default demo: accuracy on 1 and 2 replicas, and evaluate() vs numpy."""

from __future__ import annotations

import json

import keras
import numpy as np

from models import digits
from models.configs import digits as digits_config
from tests.conftest import early_main, final_results

mirrored_main = early_main("mirrored_main",
                           "test_main_on_two_mirrored_virtual_devices_reaches_95_percent",
                           "--config.distribute.virtual_devices=2",
                           "--config.distribute.strategy=mirrored")


def test_fit_reaches_95_percent_and_evaluate_matches_hand_computation():
    config = digits_config.get_config()
    config.distribute.strategy = "one_device"
    t = digits.DigitsTrainer(config)
    results = t.fit()
    assert results["eval/accuracy"] >= 0.95

    evaluation = t.evaluate()
    (_, _), (x_test, y_test) = digits.load_digits_split(config.data.split_seed)
    logits = np.asarray(t.model(x_test, training=False))
    losses = keras.losses.sparse_categorical_crossentropy(y_test, logits, from_logits=True)
    assert abs(evaluation["accuracy"] - np.mean(np.argmax(logits, 1) == y_test)) <= 1e-6
    assert abs(evaluation["loss"] - float(np.mean(losses))) <= 1e-5
    assert evaluation["accuracy"] == results["eval/accuracy"]


def test_main_on_two_mirrored_virtual_devices_reaches_95_percent(mirrored_main):
    proc, tmp_path = mirrored_main.result(), mirrored_main.workdir
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "replicas in sync: 2" in proc.stderr
    assert final_results(proc)["eval/accuracy"] >= 0.95
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["distribute"]["virtual_devices"] == 2
    assert written["trainer"] == "models.digits:DigitsTrainer"
