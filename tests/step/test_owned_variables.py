"""Variables a Trainer holds itself (trainer/step/owned_variables.py): a learnable
log-temperature made in build_model is trained by the default step, averaged by the EMA,
saved and restored by checkpoints. One replica here; 1 vs 2 replicas (and a tape step
through ``self.apply_gradients``) in the model property
(tests/properties/test_model_properties.py, its ``owned`` specs); the refusal of one made
outside the strategy's scope in tests/checks/hook_mistakes.py."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tests.support import toy


class LogTemperatureTrainer(toy.ToyTrainer):
    """CLIP-style: the logits are scaled by exp(a learnable log-temperature)."""

    def build_model(self):
        self.log_temp = tf.Variable(0.0, trainable=True)
        self.heads = {"bias": [keras.Variable(np.zeros(3, np.float32))]}
        self.frozen = tf.Variable(1.0, trainable=False)  # not trainable: not trained
        return super().build_model()

    def compute_loss(self, batch, outputs):
        logits = outputs * tf.exp(self.log_temp) * self.frozen + self.heads["bias"][0]
        return super().compute_loss(batch, logits)


def _config(**overrides):
    return toy.toy_config(**{"train.steps": 10, "optimizer.ema_decay": 0.9,
                             "telemetry.progress": "off", **overrides})


def test_the_default_step_trains_them_and_the_ema_averages_them(tmp_path):
    t = LogTemperatureTrainer(_config(), str(tmp_path))
    assert [path for path, _ in t.gradients.owned] == ["heads/bias/0", "log_temp"]
    t.fit()
    assert float(t.log_temp.numpy()) != 0.0  # it was never trained before
    assert np.abs(t.heads["bias"][0].numpy()).max() > 0
    assert float(t.frozen.numpy()) == 1.0
    averaged = {id(weight) for weight, _ in t.ema.pairs}
    assert id(t.log_temp) in averaged and id(t.heads["bias"][0]) in averaged


def test_a_checkpoint_saves_and_restores_them(tmp_path):
    trained = LogTemperatureTrainer(_config(), str(tmp_path))
    trained.fit()
    restored = LogTemperatureTrainer(_config(), str(tmp_path))
    assert restored.restore() == 10
    assert float(restored.log_temp.numpy()) == float(trained.log_temp.numpy())
    np.testing.assert_array_equal(restored.heads["bias"][0].numpy(),
                                  trained.heads["bias"][0].numpy())
