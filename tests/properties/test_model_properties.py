"""Property: a drawn Keras model trains to the same weights on 1 and 2 Mirrored replicas.

Hypothesis draws a model SPEC (tests/properties/model_specs.py: dense, Embedding with
mask_zero over variable-length padded ids, StringLookup over strings, dict inputs and
outputs, batch norm (synchronized by its layer, by distribute.sync_batch_norm, or not:
then 2 replicas must say so), state a layer updates in its forward pass, frozen layers,
regularizers, add_loss, Dropout of rate 0 or 0.5, a SeedGenerator the Trainer holds
drawing noise in the loss; the framework's step, a tape step, one over the
gathered global batch (all_gather), or the Keras guide's (it must be refused);
variables the Trainer holds itself (trained with the model), a LossScaleOptimizer (taken
apart) and Keras optimizer arguments (clipping and use_ema held; accumulation,
loss_scale_factor and ema_overwrite_frequency refused with one line);
feature widths, dtypes, sequence lengths, padding, batch 8 or 16, 2 to 4 Adam steps) and
sends it to two long-lived workers (run_spec_worker.py), one per replica count, started
once for this module: they train it at the same time, and the final weights must agree
within ``TOL`` relative (tests/support/families.py's, as in test_model_families.py). A spec
that draws random numbers trains to other weights on 2 replicas (they draw other numbers
than one replica) and must instead resume bit-equal on each: stopped after half its steps
and resumed by a new Trainer, it ends where the uninterrupted run ends. A spec of plan
"auto" measures its plan on a rehearsal (a copy of the run, rewound) and must end, on
each replica count, bit-equal to the plan it kept pinned from the start.
Profiles: tests/README.md.
"""

from __future__ import annotations

import json

import numpy as np
from hypothesis import assume, event, example, given, note, settings

from tests.properties import model_specs, profiles
from tests.properties.run_spec_worker import (answers_of_every_replica_count, differences,
                                              train_on_every_replica_count, weights)
from tests.support.families import TOL

#: examples of the property in the ``ci`` profile (scaled by the profile)
EXAMPLES = 8

#: Hand-written specs tried first in every profile: each family at least once.
EVERY_FAMILY = model_specs.normalized({
    "seed": 7,
    "inputs": [
        {"kind": "dense", "width": 3, "dtype": "float64", "units": 4, "use_bias": True},
        {"kind": "tokens", "vocab": 12, "dim": 3, "min_len": 1, "max_len": 7,
         "padding": "batch", "trainable": True},
        {"kind": "strings", "vocab": 5, "oov": 0.2, "dim": 2, "min_len": 2, "max_len": 4,
         "padding": "batch"}],
    "dict_inputs": True,
    "trunk": [
        {"layer": "dense", "units": 5, "activation": "tanh", "use_bias": True,
         "trainable": False, "kernel_regularizer": None, "activity_regularizer": None},
        {"layer": "batch_norm", "momentum": 0.5, "center": True, "scale": True},
        {"layer": "dense", "units": 6, "activation": "tanh", "use_bias": True,
         "trainable": True, "kernel_regularizer": {"l1": 0.0, "l2": 0.01},
         "activity_regularizer": {"l1": 0.001, "l2": 0.0}},
        {"layer": "dropout"}, {"layer": "add_loss", "coef": 0.01}],
    "heads": [{"kind": "class", "classes": 3}, {"kind": "regress", "width": 2}],
    "dict_outputs": True,
    "train": {"global_batch": 16, "steps": 3, "steps_per_loop": 2, "learning_rate": 0.01,
              "sparse_reduce": "auto"},
})


def _variant(spec: dict, trunk: list | None = None, **train) -> dict:
    """``spec`` with another trunk and/or train settings (normalized again)."""
    spec = json.loads(json.dumps(spec))
    if trunk is not None:
        spec["trunk"] = trunk
    spec["train"].update(train)
    return model_specs.normalized(spec)


_TANH = {"layer": "dense", "units": 5, "activation": "tanh", "use_bias": True,
         "trainable": True, "kernel_regularizer": None, "activity_regularizer": None}
#: Hand-written specs of each outcome: state read after its update and a loss over the
#: gathered global batch (equal), a batch norm synchronized by distribute.sync_batch_norm
#: (equal), one that is not (warned), the Keras guide's step and a model with its own
#: train_step (refused), dropout and a Trainer's SeedGenerator (random: bit-equal after a
#: resume), the same measuring its plan (bit-equal to the kept plan pinned).
OUTCOMES = [
    _variant(EVERY_FAMILY, [_TANH, {"layer": "running_mean"}, _TANH], step="gather"),
    _variant(EVERY_FAMILY, [_TANH, {"layer": "batch_norm", "momentum": 0.5, "center": True,
                                    "scale": True, "synchronized": False}],
             sync_batch_norm=True, step="tape"),
    _variant(EVERY_FAMILY, [_TANH, {"layer": "batch_norm", "momentum": 0.5, "center": True,
                                    "scale": True, "synchronized": False}]),
    _variant(EVERY_FAMILY, step="direct_apply"),
    _variant(EVERY_FAMILY, [_TANH, {"layer": "dropout", "rate": 0.5}, _TANH], step="tape",
             noise="seed_generator"),
    _variant(EVERY_FAMILY, step="model_step"),
    _variant({**EVERY_FAMILY, "inputs": [  # fixed shapes: XLA compiles the whole step
        {"kind": "dense", "width": 3, "dtype": "float32", "units": 4, "use_bias": True},
        {"kind": "tokens", "vocab": 12, "dim": 3, "min_len": 1, "max_len": 7,
         "padding": "post", "trainable": True}]},
        [_TANH, {"layer": "dropout", "rate": 0.5}, _TANH], step="tape",
        noise="seed_generator", plan="auto", steps=10, steps_per_loop=1),
]

#: Hand-written specs of what a user brings besides the model (each run in every
#: profile): variables the Trainer holds, a LossScaleOptimizer, each Keras optimizer
#: argument the gradient path touches; equal on 1 and 2 replicas, or refused.
_ADAM = {"wrapper": None, "args": {}}
USER_OBJECTS = [
    _variant(EVERY_FAMILY, owned="nested", step="tape", keras_optimizer={
        "wrapper": "loss_scale", "args": {"clipnorm": 0.05, "use_ema": True}}),
    _variant(EVERY_FAMILY, owned="tf",
             keras_optimizer={**_ADAM, "args": {"clipvalue": 0.01}}),
    _variant(EVERY_FAMILY, owned="keras", step="gather",
             keras_optimizer={**_ADAM, "args": {"global_clipnorm": 0.05}}),
    *(_variant(EVERY_FAMILY, keras_optimizer={**_ADAM, "args": args}) for args in (
        {"gradient_accumulation_steps": 4}, {"loss_scale_factor": 8.0},
        {"use_ema": True, "ema_overwrite_frequency": 2})),
]


def check_same_weights(workers: dict, spec: dict) -> None:
    """The property: 1 and 2 replicas train the spec to the same weights, or both refuse
    it with one line, or 2 replicas say why they differ (model_specs.expected_outcome):
    never a silent difference."""
    assert json.loads(json.dumps(spec)) == spec  # a spec is plain JSON
    note(f"spec: {json.dumps(spec, sort_keys=True)}")
    expected = model_specs.expected_outcome(spec)
    event(f"{expected}: {model_specs.describe(spec)}")
    if expected == "refused":
        start, names = model_specs.refusal(spec)
        answers = answers_of_every_replica_count(workers, spec)
        for n, answer in answers.items():
            assert answer.get("error", "").startswith(start), (n, answer)
            assert names in answer["error"], answer["error"]
            assert "\n" not in answer["error"], answer["error"]
        return
    runs = train_on_every_replica_count(workers, spec)
    said = [w for w in runs[2]["warnings"] if "BatchNormalization layer(s)" in w]
    assert len(said) == (1 if expected == "warned" else 0), runs[2]["warnings"]
    assert not [w for w in runs[1]["warnings"] if "BatchNormalization layer(s)" in w]
    if spec["train"].get("plan") == "auto":
        check_measuring_changes_nothing(runs)
    if expected == "warned":  # the weights differ by design, and the run said so
        return
    if expected == "random":  # other draws than one replica's; a resume draws the same
        for n, run in runs.items():
            for name, a, b in zip(run["names"], weights(run, "final"), weights(run, "resumed")):
                assert np.array_equal(a, b), (
                    f"{n} replica(s): {name} resumed at half the steps differs from the "
                    f"uninterrupted run by {np.max(np.abs(a - b)):.3g}")
        return
    assert any(not np.array_equal(a, b)  # the run trained (guards the comparison)
               for a, b in zip(weights(runs[1], "initial"), weights(runs[1], "final")))
    diffs = differences(runs, 2)
    worst = max(diffs.values())
    assert worst <= TOL, (f"1 vs 2 replicas differ by {worst:.3g} relative (> {TOL}); "
                          f"per weight: {json.dumps(diffs)}")


def check_measuring_changes_nothing(runs: dict) -> None:
    """On each replica count, the run that measured its plan (a rehearsal, rewound) ends
    on the values (weights, the Trainer's SeedGenerator state) of the kept plan pinned."""
    for n, run in runs.items():
        plan = run["plan"]
        event(f"plan auto on {n} replica(s): {plan['source']}, kept {plan['chosen']}")
        for name, a, b in zip(run["names"], weights(run, "final"), weights(run, "pinned")):
            assert np.array_equal(a, b), (
                f"{n} replica(s): {name} after measuring the plan ({plan['source']}, kept "
                f"{plan['chosen']}) differs from the kept plan pinned from the start by "
                f"{np.max(np.abs(a.astype(float) - b.astype(float))):.3g}")


@example(spec=EVERY_FAMILY)
@example(spec=OUTCOMES[0])
@example(spec=OUTCOMES[1])
@example(spec=OUTCOMES[2])
@example(spec=OUTCOMES[3])
@example(spec=OUTCOMES[4])
@example(spec=OUTCOMES[6])
@example(spec=USER_OBJECTS[0])
@example(spec=USER_OBJECTS[1])
@example(spec=USER_OBJECTS[2])
@example(spec=USER_OBJECTS[3])
@example(spec=USER_OBJECTS[4])
@example(spec=USER_OBJECTS[5])
@settings(max_examples=profiles.examples(EXAMPLES))
@given(spec=model_specs.specs())
def test_a_drawn_model_trains_to_the_same_weights_on_one_and_two_replicas(spec_workers,
                                                                          spec):
    # Not comparable relatively: a moving mean that is zero but for rounding.
    assume(not model_specs.normalizes_a_centred_batch(spec))
    check_same_weights(spec_workers, spec)


def _bn(center: bool) -> dict:
    return {"layer": "batch_norm", "momentum": 0.0, "center": center, "scale": False,
            "synchronized": True}


def test_a_mean_kept_of_an_input_already_centred_is_excluded_and_nothing_else():
    # Found by the random profile: a running mean after BatchNormalization(center=False)
    # kept 1.0e-8 on one replica and 4.7e-10 on two (rounding of a zero).
    running = {"layer": "running_mean"}
    excluded = [[_bn(False), running], [_bn(False), _bn(True)],
                [_bn(False), {"layer": "dropout"}, running, _bn(True)]]
    compared = [[_bn(True), running], [_bn(False), _TANH, running], [running, _bn(True)],
                [_bn(False), {"layer": "layer_norm", "center": True}, running]]
    for trunk in excluded:
        assert model_specs.normalizes_a_centred_batch(_variant(EVERY_FAMILY, trunk)), trunk
    for trunk in compared:
        assert not model_specs.normalizes_a_centred_batch(_variant(EVERY_FAMILY, trunk)), trunk
