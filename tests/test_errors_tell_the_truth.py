"""Errors blame a hook only when the framework has checked that the hook is the cause;
variable-length batches keep XLA out of the plan with the reason (issue: a collective's
failure used to read "Input error ... fix the hook")."""

from __future__ import annotations

import keras
import pytest
import tensorflow as tf

from models.text_classifier import make_sequences, sequence_dataset
from tests.support import families
from tests.support.toy import ToyTrainer, toy_config
import trainer
from trainer.checks import inputs as checks
from trainer.errors import InputError, TensorFlowError

COLLECTIVE = ("Collective ops is aborted by: Shape mismatch in the collective instance 101. "
              "Op at device /job:localhost/replica:0/task:0/device:CPU:0 expected shape "
              "[1856,16] but another member in the group expected shape [1920,16]. This is "
              "likely due to different input shapes at different members of the collective "
              "op.\nThe error could be from a previous operation. Restart your program to "
              "reset.\n\t [[{{node cond/CollectiveGatherV2}}]] [Op:__inference_train_1816]")


def _error(message: str) -> tf.errors.InvalidArgumentError:
    return tf.errors.InvalidArgumentError(None, None, message)


def test_a_failed_collective_is_not_blamed_on_the_hooks():
    found = checks.runtime_error(_error(COLLECTIVE), "build_train_dataset", "steps 1-50")
    assert isinstance(found, TensorFlowError) and not isinstance(found, InputError)
    text = f"{found.prefix}: {found}"
    assert text.startswith("TensorFlow error: steps 1-50: a collective across replicas "
                           "failed: ")
    assert "Shape mismatch in the collective" in text and "fix the hook" not in text
    assert "--config.train.steps_per_loop=1" in text and "--traceback" in text


def test_an_unrecognised_runtime_error_says_what_tensorflow_said():
    found = checks.runtime_error(_error("Something odd happened in a kernel"),
                                 "build_train_dataset", "step 3")
    assert isinstance(found, TensorFlowError)
    assert "step 3: TensorFlow stopped the compiled loop fed by build_train_dataset: " \
           "Something odd happened in a kernel" in str(found)


class IdsPastTheTable(families.TextClassifierTrainer):
    """Token ids drawn from 300 for an embedding of config.model.vocab (64) rows."""

    def build_train_dataset(self, ctx):
        rows, labels = make_sequences(64, 300, 2, 8)
        return sequence_dataset(rows, labels).repeat().padded_batch(
            16, padded_shapes=([None], []), drop_remainder=True)


def test_an_index_outside_the_embedding_names_the_table():
    t = IdsPastTheTable(families.family_config("text", **{"train.steps": 2,
                                                          "train.steps_per_loop": 1}))
    with pytest.raises(InputError, match=r"step 1: indices\[.*\] = \d+ is not in \[0, 64\).*"
                                         r"outside a table of build_model's model.*"
                                         r"fix the ids in build_train_dataset"):
        t.fit()


class TripleBatches(ToyTrainer):
    def build_train_dataset(self, ctx):
        x, y = tf.zeros((64, 8)), tf.zeros((64,), tf.int32)
        return tf.data.Dataset.from_tensor_slices((x, y, y)).repeat().batch(32)

    def build_model(self):
        model = keras.Sequential([keras.layers.Dense(3)])
        model.build((None, 8))
        return model


def test_default_step_names_the_batch_structure_it_got():
    t = TripleBatches(toy_config(**{"train.steps": 2, "train.steps_per_loop": 1}))
    with pytest.raises(InputError, match=r"the dataset yields batches of a tuple of 3: "
                                         r"\(None, 8\) float32, \(None\) int32, \(None\) "
                                         r"int32; the default train_step and eval_step "
                                         r"expect \(features, labels\)"):
        t.fit()


def test_dynamic_shapes_leave_xla_out_of_the_plan_with_the_reason(caplog):
    config = families.family_config("text", **{
        "perf.plan": "auto", "perf.plan_min_run_s": 0.0, "perf.plan_trial_s": 0.01,
        "perf.plan_rounds": 2, "train.steps": 40, "train.steps_per_loop": 4,
        "train.log_every_steps": 40})
    t = families.TextClassifierTrainer(config)
    with caplog.at_level("WARNING"):
        t.fit()
    assert ("plan: XLA setting 'step' dropped from the candidates: the batches have dynamic "
            "shapes ((16, None) int32): XLA compiles once per shape") in caplog.text
    assert t.driver.planner.chosen.xla == "off"


class RaggedBatches(families.TextClassifierTrainer):
    """Ragged token ids (``.batch`` of variable-length rows) into the default step."""

    train_step = trainer.Trainer.train_step

    def build_train_dataset(self, ctx):
        rows, labels = make_sequences(64, 64, 2, 8)
        return tf.data.Dataset.from_tensor_slices((tf.ragged.constant(rows), labels)) \
            .repeat().batch(16, drop_remainder=True)


def test_ragged_features_name_the_way_that_works():
    t = RaggedBatches(families.family_config("text", **{"train.steps": 2,
                                                        "train.steps_per_loop": 1}))
    with pytest.raises(InputError, match=r"build_train_dataset yields ragged features "
                                         r"\(tf\.RaggedTensor, feature #0\) but build_model's "
                                         r"model takes dense inputs .*padded_batch"):
        t.fit()
    assert t.step == 0


def test_variable_length_batches_run_in_one_trace_of_the_loop():
    # 3 loop calls of 4 steps over batches padded to several lengths (18-20 tokens): the
    # loop is traced once (the iterator's spec has a dynamic length), not per length.
    t = families.TextClassifierTrainer(families.family_config("text", **{
        "train.steps": 12, "train.steps_per_loop": 4}))
    t.fit()
    lengths = {int(batch[0].shape[1]) for batch in t.build_train_dataset(
        tf.distribute.InputContext()).take(12)}
    assert len(lengths) > 1, lengths
    assert t.driver.loops.train.experimental_get_tracing_count() == 1
