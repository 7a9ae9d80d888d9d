"""How long an eval pass is: a dataset that never ends is refused before training, one
of unknown length is read to its end with its progress shown, and a pass in calls of
bounded length can be abandoned between two calls (what a stop signal does)."""

from __future__ import annotations

import itertools
import logging

import pytest
import tensorflow as tf

from tests.support import toy
from tests.support.run_signals import InfiniteEvalTrainer, UnknownLengthEvalTrainer
from trainer.errors import InputError
from trainer.loop.eval_pass import EvalAbandoned, run_pass

SHORT = {"train.steps": 2, "train.steps_per_loop": 1}


def test_an_infinite_eval_dataset_with_a_full_pass_is_an_error_before_training():
    trainer = InfiniteEvalTrainer(toy.toy_config(**SHORT))
    with pytest.raises(InputError, match=r"build_eval_dataset returns an infinite dataset "
                                         r"\(cardinality INFINITE.*eval.steps=-1 asks for a "
                                         r"full pass.*--config.eval.steps=100"):
        trainer.fit()
    assert trainer.step == 0


def test_an_infinite_eval_dataset_is_evaluated_for_eval_steps_batches():
    trainer = InfiniteEvalTrainer(toy.toy_config(**SHORT, **{"eval.steps": 3}))
    assert "eval/loss" in trainer.fit()


def test_an_eval_dataset_of_unknown_length_is_read_to_its_end():
    unknown = UnknownLengthEvalTrainer(toy.toy_config(**SHORT)).fit()
    known = toy.ToyEvalTrainer(toy.toy_config(**SHORT)).fit()
    assert unknown["eval/loss"] == pytest.approx(known["eval/loss"], rel=1e-6)
    assert unknown["eval/accuracy"] == known["eval/accuracy"]


@tf.function
def _count(iterator, num_steps):
    """The compiled eval loop's contract: up to ``num_steps`` batches, returns how many."""
    done = tf.constant(0, tf.int64)
    while done < num_steps:
        if not iterator.get_next_as_optional().has_value():
            break
        done += 1
    return done


def _unknown_length(n: int):
    return iter(tf.data.Dataset.range(n).filter(lambda x: x >= 0))


def test_a_long_eval_pass_logs_its_progress_until_the_data_ends(caplog):
    ticks = itertools.count(0.0, 3.0)  # every look at the clock: 3 s later
    # The absl logger's own level too: an earlier test in this process may have set
    # absl's verbosity to WARNING (as the doctor's command line does).
    with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, logger="absl"):
        done = run_pass(_count, _unknown_length(40), -1, lambda: False, "eval at step 7",
                        clock=lambda: next(ticks))
    assert done == 40
    progress = [r.getMessage() for r in caplog.records if "so far" in r.getMessage()]
    assert progress and progress[0].startswith("eval at step 7: ")
    assert progress[0].endswith("batches/s)")


def test_an_eval_pass_is_abandoned_between_two_calls_when_asked():
    looks = itertools.count()
    with pytest.raises(EvalAbandoned, match=r"eval at step 7: the eval pass was abandoned "
                                            r"after 3 batches"):
        run_pass(_count, _unknown_length(1000), -1, lambda: next(looks) == 2, "eval at step 7")
