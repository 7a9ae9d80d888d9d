"""Trainer subclasses with the mistakes a user makes in their hooks, one per class.

Importable (``config.trainer = "tests.checks.hook_mistakes:ModelIsFunction"``) so that the
same classes run in this process and under ``python -m trainer.main``. ``CASES`` maps
each class name to the regex the LAST line of the error must match (the class, the
hook, what it returned or raised, and what it must return).

    python -m tests.checks.hook_mistakes    # a config file for trainer.main: get_config()
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import trainer
from tests.support import toy


class ModelIsFunction(toy.ToyTrainer):
    def build_model(self):
        def make():
            return keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        return make


class LossIsDict(toy.ToyTrainer):
    def compute_loss(self, batch, outputs):
        return {"loss": super().compute_loss(batch, outputs)}


def accuracy(labels, outputs):
    return tf.cast(tf.equal(tf.cast(labels, tf.int64), tf.argmax(outputs, -1)), tf.float32)


class MetricIsFunction(toy.ToyTrainer):
    def build_metrics(self):
        return {"acc": accuracy}


class Stopper(trainer.Callback):
    pass


class OneCallback(toy.ToyTrainer):
    def build_callbacks(self):
        return Stopper()


class StepReturnsTensor(toy.ToyTrainer):
    def train_step(self, batch):
        return self.steps.train(batch)["loss"]


class OptimizerIsName(toy.ToyTrainer):
    def build_optimizer(self):
        return "adam"


class DatasetIsArrays(toy.ToyTrainer):
    def build_train_dataset(self, ctx):
        return toy.toy_data()


class EvalStepWithoutLoss(toy.ToyEvalTrainer):
    def eval_step(self, batch):
        return {"accuracy": tf.reduce_mean(tf.cast(batch[1], tf.float32))}


class UpdateMetricsReturns(toy.ToyEvalTrainer):
    def update_metrics(self, metrics, batch, outputs):
        super().update_metrics(metrics, batch, outputs)
        return metrics


class IntegerLoss(toy.ToyTrainer):
    def compute_loss(self, batch, outputs):
        return tf.argmax(outputs, axis=-1)


class KerasShapeErrorInStep(toy.ToyTrainer):
    """The user's own step feeds the model the wrong features (7 of its 8 columns)."""

    def train_step(self, batch):
        outputs = self.model(batch[0][:, :7], training=True)
        return {"loss": tf.reduce_mean(outputs)}


class SubclassedModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(tf.reshape(x, [-1, 5]))  # the user's bug: 8 features


class ModelCallFails(toy.ToyTrainer):
    """Default steps; the model itself fails on the batch (a structure/shape error)."""

    def build_model(self):
        model = SubclassedModel()
        model(np.zeros((1, 10), np.float32))  # built, on the wrong feature count
        return model


class TypoInBuildModel(toy.ToyTrainer):
    def build_model(self):
        units = self.config.model.hidden_units  # no such field
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(units)])


class KerasGuideStep(toy.ToyTrainer):
    """The Keras guide's custom step: a loss averaged over the replica's batch, then the
    optimizer applied directly (Keras sums the replicas' gradients: N times too large)."""

    def train_step(self, batch):
        with tf.GradientTape() as tape:
            outputs = self.model(batch[0], training=True)
            loss = tf.reduce_mean(self.compute_loss(batch, outputs))
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return {"loss": loss}


class WarmupMean(keras.layers.Layer):
    """A running mean updated only after a warm-up: the assign sits inside a tf.cond."""

    def build(self, shape):
        self.mean = self.add_weight(shape=(shape[-1],), initializer="zeros",
                                    trainable=False, name="mean")
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                    name="seen", dtype="int64")

    def call(self, x, training=False):
        if training:
            self.seen.assign_add(1)
            tf.cond(self.seen > 2,
                    lambda: self.mean.assign(0.9 * self.mean + 0.1 * tf.reduce_mean(x, 0)),
                    lambda: self.mean)
        return x - self.mean


class StateUpdateInCond(toy.ToyTrainer):
    def build_model(self):
        return keras.Sequential([keras.Input((8,)), WarmupMean(), keras.layers.Dense(3)])


class NoComputeLoss(trainer.Trainer):
    build_model = toy.ToyTrainer.build_model
    build_train_dataset = toy.ToyTrainer.build_train_dataset


class EvalDatasetNone(toy.ToyTrainer):
    def build_eval_dataset(self, ctx):
        return None


#: class name -> regex of the last line (after the "Hook error: " / "Input error: " prefix).
CASES = {
    "ModelIsFunction": r"ModelIsFunction\.build_model returned a function 'make'; it must "
                       r"return a keras\.Model .*\(call the function that builds the model",
    "LossIsDict": r"LossIsDict\.compute_loss returned a dict with keys \['loss'\]; it must "
                  r"return the per-example loss: a float tensor of shape \[per-replica "
                  r"batch\] \(return the loss tensor itself, not a dict\)",
    "MetricIsFunction": r"MetricIsFunction\.build_metrics returned a dict with keys "
                        r"\['acc'\]; it must return a dict of keras\.metrics\.Metric by name "
                        r".*\('acc' is a function 'accuracy': wrap a function: "
                        r"keras\.metrics\.MeanMetricWrapper\(accuracy, name='acc'\)\)",
    "OneCallback": r"OneCallback\.build_callbacks returned a Callback \(Stopper\); it must "
                   r"return a list of trainer\.Callback \(\[\] for none\) \(wrap it: "
                   r"\[Stopper\(\)\]\)",
    "StepReturnsTensor": r"StepReturnsTensor\.train_step returned a tensor of shape \(\) "
                         r"float32; it must return a dict of scalar tensors with a 'loss' "
                         r"entry .*\(return \{'loss': loss\}\)",
    "OptimizerIsName": r"OptimizerIsName\.build_optimizer returned a str; it must return a "
                       r"keras optimizer .*\(keras\.optimizers\.get\('adam'\) makes one\)",
    "DatasetIsArrays": r"DatasetIsArrays\.build_train_dataset returned a tuple of 2 "
                       r"\(ndarray\); it must return a tf\.data\.Dataset of per-replica "
                       r"batches \(wrap the arrays: tf\.data\.Dataset\.from_tensor_slices",
    "EvalStepWithoutLoss": r"EvalStepWithoutLoss\.eval_step returned a dict with keys "
                           r"\['accuracy'\]; it must return a dict with a 'loss' entry.*"
                           r"\(add the 'loss' entry\)",
    "UpdateMetricsReturns": r"UpdateMetricsReturns\.update_metrics returned a dict with keys "
                            r"\['accuracy'\]; it must return None",
    "IntegerLoss": r"IntegerLoss\.compute_loss returned a tensor of shape \(32,\) int64; it "
                   r"must return the per-example loss.*\(its dtype is int64: tf\.cast it",
    "KerasShapeErrorInStep": r"KerasShapeErrorInStep\.train_step raised ValueError: .*"
                             r"expected axis -1 of input shape to have value 8.*"
                             r"\[hook_mistakes\.py:\d+\]",
    "ModelCallFails": r"ModelCallFails\.train_step \(the default: build_model's model on a "
                      r"batch of build_train_dataset\) raised \w+: .*",
    "TypoInBuildModel": r"TypoInBuildModel\.build_model raised AttributeError: .*"
                        r"hidden_units.* \[hook_mistakes\.py:\d+\]",
    "NoComputeLoss": r"NoComputeLoss does not override compute_loss: Override "
                     r"compute_loss\(batch, outputs\)",
    "KerasGuideStep": r"KerasGuideStep\.train_step calls SGD\.apply \(or apply_gradients\) "
                      r"itself: Keras then sums every replica's gradients, .* call "
                      r"self\.apply_gradients\(tape, per_example_loss\) .*or set "
                      r"manual_optimization = True on KerasGuideStep",
    "EvalDatasetNone": r"EvalDatasetNone\.build_eval_dataset returned None; it must return "
                       r"a tf\.data\.Dataset .*do not override build_eval_dataset",
    "OwnedVariableOutsideScope": r"OwnedVariableOutsideScope\.log_temp is a trainable "
                                 r"variable created outside strategy\.scope\(\): .*created "
                                 r"in build_model\(\)",
    "KerasAccumulation": r"KerasAccumulation\.build_optimizer returned Adam\("
                         r"gradient_accumulation_steps=4\): .*leave "
                         r"gradient_accumulation_steps unset and set "
                         r"perf\.grad_accum_steps=4 \(--config\.perf\.grad_accum_steps=4\)",
    "KerasLossScaleFactor": r"KerasLossScaleFactor\.build_optimizer returned SGD\("
                            r"loss_scale_factor=8\): Keras divides every gradient by it.*"
                            r"precision\.initial_loss_scale",
    "ModelWithTrainStep": r"ModelWithTrainStep\.build_model returned a GuideModel whose "
                          r"train_step is overridden: the Trainer never calls .*Move it into "
                          r"ModelWithTrainStep\.train_step\(batch\) .*self\.apply_gradients",
    "LayerBesideModel": r"LayerBesideModel\.head is a Keras layer \(Dense\) outside the model, "
                        r"with 2 trainable weights .*LayerBesideModel\.head\.trainable = False",
    "UnbuiltLayerBesideModel": r"UnbuiltLayerBesideModel\.head is a Keras layer \(Dense\) outside "
                               r"the model, with 2 trainable weights .*"
                               r"UnbuiltLayerBesideModel\.head\.trainable = False",
    "KerasEmaOverwrite": r"KerasEmaOverwrite\.build_optimizer returned Adam\(use_ema=True, "
                         r"ema_overwrite_frequency=5\): .*optimizer\.ema_decay",
    "SecondLossScaleOptimizer": r"SecondLossScaleOptimizer\.build_optimizer_variables was "
                                r"given a LossScaleOptimizer: the framework scales the loss "
                                r"itself .*pass its inner_optimizer \(SGD\) instead",
}


class OwnedVariableOutsideScope(toy.ToyTrainer):
    def __init__(self, config):
        self.log_temp = tf.Variable(0.0)  # before the strategy exists: outside its scope
        super().__init__(config)


class KerasAccumulation(toy.ToyTrainer):
    def build_optimizer(self):
        return keras.optimizers.Adam(1e-2, gradient_accumulation_steps=4)


class KerasLossScaleFactor(toy.ToyTrainer):
    def build_optimizer(self):
        return keras.optimizers.SGD(0.1, loss_scale_factor=8.0)


class KerasEmaOverwrite(toy.ToyTrainer):
    def build_optimizer(self):
        return keras.optimizers.Adam(1e-2, use_ema=True, ema_overwrite_frequency=5)


class SecondLossScaleOptimizer(toy.ToyTrainer):
    def build_model(self):
        model = super().build_model()
        self.critic_optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        self.build_optimizer_variables(self.critic_optimizer, model.trainable_variables)
        return model


class GuideModel(keras.Model):
    """The Keras guide "Customizing what happens in fit()": a model with its own step."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                             self.trainable_variables)
        return {"loss": loss}


class ModelWithTrainStep(toy.ToyTrainer):
    def build_model(self):
        return GuideModel()


class LayerBesideModel(toy.ToyTrainer):
    def build_model(self):
        self.head = keras.layers.Dense(3)
        self.head.build((None, 3))
        return super().build_model()


class UnbuiltLayerBesideModel(toy.ToyTrainer):
    """Its head has no weights until the step calls it: refused once the step is traced
    (before: with a constant initializer, trained silently without its head; with a
    random one, an UnliftableError)."""

    def build_model(self):
        self.head = keras.layers.Dense(3, kernel_initializer="ones")
        return super().build_model()

    def compute_loss(self, batch, outputs):
        return super().compute_loss(batch, self.head(outputs))


def get_config():
    """The toy config (tiny, fast) for ``python -m trainer.main``; the test overrides
    ``config.trainer`` with one of the classes above."""
    config = toy.toy_config(**{"train.steps": 2, "train.steps_per_loop": 1})
    config.trainer = "tests.checks.hook_mistakes:ModelIsFunction"
    return config

# Mistakes that only show on several replicas (one replica needs no synchronisation):
# the class and the regex of its message, run on 2 Mirrored replicas by the tests.
MULTI_REPLICA_CASES = {
    "StateUpdateInCond": r"StateUpdateInCond\.train_step \(the default: .*\) updates, inside "
                         r"a tf\.cond or a loop, a variable that every replica must agree on "
                         r".*assign it once outside",
}
