"""Drawn Keras models for the replica-count property (test_model_properties.py).

A model SPEC is a JSON-serializable dict: the property draws one with :func:`specs`,
sends it as one JSON line to a long-lived worker per replica count
(``run_spec_worker.py``), and each worker turns it into a Trainer, config and data with
this module and trains it. The same spec gives the same model, initial weights and
batches in every process (everything is seeded from ``spec["seed"]``).

A spec::

    {"seed": 123,
     "inputs": [  # 1 to 3; named in0, in1, ...; a dict of inputs when "dict_inputs"
        {"kind": "dense", "width": 4, "dtype": "float32"|"float64"|"int32", "units": 0|n,
         "use_bias": true},  # units: a Dense (no activation) on the features, 0: none
        {"kind": "tokens", "vocab": 20, "dim": 4, "min_len": 1, "max_len": 9,
         "padding": "batch"|"post"|"pre", "trainable": true},
            # Embedding(mask_zero=True) + masked mean over int32 ids (0 = padding);
            # "batch": padded_batch to each (per-replica) batch's longest sequence,
            # "post"/"pre": padded to max_len after/before the tokens
        {"kind": "strings", "vocab": 6, "oov": 0.2, "dim": 3, "min_len": 1,
         "max_len": 5, "padding": "batch"|"post"},
            # StringLookup(mask_token="") + Embedding(mask_zero=True) + masked mean
     ],
     "dict_inputs": true,
     "trunk": [  # 0 to 4 layers over the concatenated branches
        {"layer": "dense", "units": 5, "activation": null|"tanh"|"relu", "use_bias": true,
         "trainable": true, "kernel_regularizer": null|{"l1": 0.0, "l2": 0.01},
         "activity_regularizer": null|{"l1": 0.001, "l2": 0.0}},
        {"layer": "batch_norm", "momentum": 0.9, "center": true, "scale": true,
         "synchronized": true},  # BatchNormalization(synchronized=...)
        {"layer": "running_mean"},  # centres on a running mean it updates in call (float
            # state read after its update: averaged over the replicas at each assign)
        {"layer": "dropout", "rate": 0.0|0.5},   # Dropout(rate); no "rate": 0.0
        {"layer": "add_loss", "coef": 0.01},   # add_loss(coef * mean(x**2))
        {"layer": "layer_norm", "center": true}],
     "heads": [  # 1 or 2; named out0, out1; dict outputs and dict labels when "dict_outputs"
        {"kind": "class", "classes": 3} | {"kind": "regress", "width": 2}],
     "dict_outputs": false,
     "train": {"global_batch": 8|16, "steps": 3, "steps_per_loop": 1,  # steps: 2 to 4,
            # 8 to 12 with plan "auto" (room for the plan's trials)
               "learning_rate": 0.01, "sparse_reduce": "auto"|"dense"|"gather",
               "sync_batch_norm": false,  # distribute.sync_batch_norm
               "step": "default"|"tape"|"gather"|"direct_apply"|"model_step",
            # the train_step: the framework's; a tape and self.apply_gradients; the same
            # plus a term over the whole global batch through self.all_gather; the Keras
            # guide's (a mean loss, then optimizer.apply_gradients: refused); the
            # framework's, with a model whose class overrides Keras' train_step (the
            # guide "Customizing what happens in fit()": refused)
               "plan": "fixed"|"auto",
            # perf.plan; "auto" measures however short the run (perf.plan_min_run_s=0,
            # one round of one-step trials, no plan cache): a rehearsal on a copy of
            # the run, rewound; absent: "fixed"
               "noise": null|"seed_generator",
            # the Trainer holds a keras.random.SeedGenerator (made in build_model) and
            # every head's outputs become outputs * (1 + 0.1 * keras.random.normal(...))
               "owned": null|"tf"|"keras"|"nested",
            # variables the Trainer holds itself, made in build_model (trained with the
            # model): self.log_temp = tf.Variable(0.0) / keras.Variable(0.0), or
            # self.temps = {"scale": [tf.Variable(0.0)], "shift": keras.Variable(0.0)};
            # every head's outputs become outputs * exp(scale) (* (1 + shift)); an added
            # shift would have a zero gradient through a softmax (the exclusion below)
               "keras_optimizer": {"wrapper": null|"loss_scale", "args": {...}}}}
            # build_optimizer returns Adam(learning_rate, **args), wrapped in a
            # keras.optimizers.LossScaleOptimizer for "loss_scale" (taken apart); args:
            # at most one of clipnorm / clipvalue / global_clipnorm, and use_ema, or a
            # Keras argument the framework refuses (gradient_accumulation_steps,
            # loss_scale_factor, use_ema with ema_overwrite_frequency)

What the property expects of a spec (:func:`expected_outcome`): ``"refused"`` (a
``direct_apply`` or ``model_step`` step or a refused optimizer argument: one Hook error
line, on every replica count, :func:`refusal` says which), ``"warned"`` (a batch norm that is not
synchronized, neither by its layer nor by ``sync_batch_norm``, on 2 replicas: one
warning naming it; the weights differ by design), ``"random"`` (a dropout rate above
zero or the Trainer's SeedGenerator noise: the replicas draw other numbers than one
replica, so the weights differ by design; on each replica count a run stopped after
half its steps and resumed (a new Trainer in its workdir) ends bit-equal to the
uninterrupted run) or ``"equal"`` (the same weights on 1 and 2 replicas). Whatever the
outcome, a spec of plan ``"auto"`` (not refused) ends, on each replica count, bit-equal
(weights and the Trainer's SeedGenerator state) to the same spec with the plan it kept
pinned from the start (:func:`train_spec`; the resumed run above runs that plan pinned):
measuring never changes the numbers (trainer/loop/rehearsal.py).

The loss is the per-example sum over heads (sparse softmax cross-entropy for a class
head, squared error averaged over the width for a regression head); the optimizer Adam.

Excluded by construction (each a numerical limit, not a framework promise): a bias (a
Dense's, a normalization's ``center``) that reaches a batch norm only through affine
layers and ReLUs (:func:`normalized` switches it off: its gradient is zero but for
rounding, through a ReLU for each unit active on the whole batch, and Adam scales
rounding noise up to full-size steps, differently per replica count; found under the
``ci`` profile: a Dense(3, relu) bias before a synchronized batch norm, 2.5e-5 relative
off after 3 steps with ``global_clipnorm``, the other weights <= 3.5e-6), an
input that is the same for every example (a one-word string vocabulary: the same). The
property also skips a
batch norm or a running mean of an input already centred over the batch
(:func:`normalizes_a_centred_batch`).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

EXAMPLES = 64  # examples per spec's dataset (repeated); a run reads at most 4 x 16

# ---------------------------------------------------------------------------- the draws

_REG = st.one_of(st.none(), st.fixed_dictionaries({
    "l1": st.sampled_from([0.0, 1e-3, 1e-2]), "l2": st.sampled_from([0.0, 1e-3, 1e-2])}))


def _lengths():
    return st.integers(1, 4).flatmap(
        lambda lo: st.tuples(st.just(lo), st.integers(lo, lo + 8)))


def _dense_input():
    return st.fixed_dictionaries({
        "kind": st.just("dense"), "width": st.integers(1, 6),
        "dtype": st.sampled_from(["float32", "float64", "int32"]),
        "units": st.sampled_from([0, 0, 3, 8]),  # 0: the features go in as they are
        "use_bias": st.just(True)})


def _token_input():
    return st.builds(
        lambda vocab, dim, lengths, padding, trainable: {
            "kind": "tokens", "vocab": vocab, "dim": dim, "min_len": lengths[0],
            "max_len": lengths[1], "padding": padding, "trainable": trainable},
        st.integers(3, 40), st.integers(1, 6), _lengths(),
        st.sampled_from(["batch", "post", "pre"]),
        st.sampled_from([True, True, True, False]))


def _string_input():
    return st.builds(
        lambda vocab, oov, dim, lengths, padding: {
            "kind": "strings", "vocab": vocab, "oov": oov, "dim": dim,
            "min_len": lengths[0], "max_len": lengths[1], "padding": padding},
        # two words at least: one word and no OOV make the same input for every example
        # (a constant shift: the exclusion of the module docstring)
        st.integers(2, 12), st.sampled_from([0.0, 0.2, 0.5]), st.integers(1, 5),
        _lengths(), st.sampled_from(["batch", "post"]))


def _trunk_layer():
    return st.one_of(
        st.fixed_dictionaries({
            "layer": st.just("dense"), "units": st.integers(1, 8),
            "activation": st.sampled_from([None, "tanh", "relu"]),
            "use_bias": st.booleans(), "trainable": st.sampled_from([True, True, False]),
            "kernel_regularizer": _REG, "activity_regularizer": _REG}),
        st.fixed_dictionaries({
            "layer": st.just("batch_norm"), "momentum": st.sampled_from([0.0, 0.5, 0.99]),
            "center": st.booleans(), "scale": st.booleans(),
            "synchronized": st.sampled_from([True, True, False])}),
        st.just({"layer": "running_mean"}),
        st.fixed_dictionaries({"layer": st.just("dropout"),
                               "rate": st.sampled_from([0.0, 0.0, 0.5])}),
        st.fixed_dictionaries({"layer": st.just("add_loss"),
                               "coef": st.sampled_from([1e-3, 1e-2, 1e-1])}),
        st.just({"layer": "layer_norm", "center": True}),
    )


#: Keras optimizer arguments the framework refuses, each with what its one line names.
REFUSED_ARGS = {"gradient_accumulation_steps": "perf.grad_accum_steps=",
                "loss_scale_factor": "precision.initial_loss_scale",
                "ema_overwrite_frequency": "optimizer.ema_decay"}


def _optimizer():
    one = lambda key, values: st.fixed_dictionaries(  # noqa: E731
        {key: st.sampled_from(values)})
    clip = st.one_of(st.just({}), one("clipnorm", [0.05, 1.0]),
                     one("clipvalue", [0.01, 1.0]), one("global_clipnorm", [0.05, 1.0]))
    other = st.one_of(st.just({}), st.just({}), st.just({"use_ema": True}),
                      st.just({"use_ema": True, "ema_overwrite_frequency": 2}),
                      one("gradient_accumulation_steps", [2, 4]),
                      one("loss_scale_factor", [8.0]))
    return st.fixed_dictionaries({
        "wrapper": st.sampled_from([None, None, "loss_scale"]),
        "args": st.builds(lambda a, b: {**a, **b}, clip, other)})


def _head():
    return st.one_of(
        st.fixed_dictionaries({"kind": st.just("class"), "classes": st.integers(2, 4)}),
        st.fixed_dictionaries({"kind": st.just("regress"), "width": st.integers(1, 3)}))


@st.composite
def specs(draw) -> dict[str, Any]:
    """A random model spec (see the module docstring), JSON-serializable."""
    inputs = draw(st.lists(st.one_of(_dense_input(), _token_input(), _string_input()),
                           min_size=1, max_size=3))
    heads = draw(st.lists(_head(), min_size=1, max_size=2))
    plan = draw(st.sampled_from(["fixed", "fixed", "fixed", "auto"]))
    steps = draw(st.integers(8, 12) if plan == "auto" else st.integers(2, 4))
    spec = {
        "seed": draw(st.integers(0, 2**16)),
        "inputs": inputs,
        "dict_inputs": len(inputs) > 1 or draw(st.booleans()),
        "trunk": draw(st.lists(_trunk_layer(), max_size=4)),
        "heads": heads,
        "dict_outputs": len(heads) > 1 or draw(st.booleans()),
        "train": {
            "global_batch": draw(st.sampled_from([8, 16])), "steps": steps,
            "steps_per_loop": draw(st.integers(1, steps)),
            "learning_rate": draw(st.sampled_from([3e-3, 1e-2, 3e-2])),
            "sparse_reduce": draw(st.sampled_from(["auto", "dense", "gather"])),
            "sync_batch_norm": draw(st.booleans()),
            "step": draw(st.sampled_from(["default", "default", "tape", "gather",
                                          "direct_apply", "model_step"])),
            "owned": draw(st.sampled_from([None, None, "tf", "keras", "nested"])),
            "plan": plan,
            "noise": draw(st.sampled_from([None, None, None, "seed_generator"])),
            "keras_optimizer": draw(st.one_of(st.none(), _optimizer())),
        },
    }
    return normalized(spec)


def normalized(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec (a copy) without the excluded combination of the module docstring: a
    bias (a Dense's bias, a normalization's ``center``) that reaches a batch norm only
    through affine layers and ReLUs is switched off (``use_bias``/``center`` False): the
    batch norm subtracts any constant shift, so its gradient is zero but for rounding
    (through a ReLU, for each unit active on the whole batch)."""
    spec = json.loads(json.dumps(spec))
    pending = [inp for inp in spec["inputs"] if inp["kind"] == "dense" and inp["units"]
               and inp.get("use_bias", True)]  # (a Dense with no activation)
    for layer in spec["trunk"]:
        kind = layer["layer"]
        if kind == "dense":
            if layer["activation"] not in (None, "relu"):
                pending = []  # its bias, and those before, go through the nonlinearity
            elif layer["use_bias"]:  # relu: affine over a batch on which a unit is active
                pending.append(layer)
        elif kind == "batch_norm":
            for biased in pending:
                biased["use_bias" if "use_bias" in biased else "center"] = False
            pending = [layer] if layer["center"] else []
        elif kind == "layer_norm":  # normalizes each example: a nonlinearity
            pending = [layer] if layer["center"] else []
    return spec


def refusal(spec: dict[str, Any]) -> tuple[str, str] | None:
    """``(how the error starts, what else it names)`` when the spec is refused, else
    None: an optimizer argument at build (first), or the Keras guide's step at trace."""
    args = (spec["train"].get("keras_optimizer") or {}).get("args", {})
    for key, fix in REFUSED_ARGS.items():
        if key in args:
            return "HookError: SpecTrainer.build_optimizer returned Adam(", fix
    if spec["train"].get("step") == "direct_apply":
        return ("HookError: SpecTrainer.train_step calls ",
                "self.apply_gradients(tape, per_example_loss)")
    if spec["train"].get("step") == "model_step":
        return ("HookError: SpecTrainer.build_model returned a GuideStepModel whose "
                "train_step is overridden", "SpecTrainer.train_step(batch)")
    return None


def expected_outcome(spec: dict[str, Any]) -> str:
    """``"refused"``, ``"warned"``, ``"random"`` or ``"equal"`` (see the module
    docstring)."""
    if refusal(spec) is not None:
        return "refused"
    unsynchronized = any(layer["layer"] == "batch_norm" and not layer.get("synchronized", True)
                         for layer in spec["trunk"])
    if unsynchronized and not spec["train"].get("sync_batch_norm", False):
        return "warned"
    if draws_random_numbers(spec):
        return "random"
    return "equal"


def draws_random_numbers(spec: dict[str, Any]) -> bool:
    """Whether the spec's step draws random numbers (a dropout rate above zero, the
    Trainer's SeedGenerator noise)."""
    return (spec["train"].get("noise") is not None
            or any(layer["layer"] == "dropout" and layer.get("rate", 0.0) > 0
                   for layer in spec["trunk"]))


def normalizes_a_centred_batch(spec: dict[str, Any]) -> bool:
    """Whether a batch norm's or a running mean's input is already centred over the
    batch (a batch norm without ``center``, then only bias-free affine layers, running
    means, dropout or add_loss): the mean it keeps is then zero but for rounding, which
    no relative comparison can judge (the property excludes it with ``assume``; found
    by the random profile: a running mean after ``BatchNormalization(center=False)``
    kept 1.0e-8 on one replica and 4.7e-10 on two, 0.955 "relative")."""
    centred = False
    for layer in spec["trunk"]:
        kind = layer["layer"]
        if kind in ("batch_norm", "running_mean") and centred:
            return True
        if kind == "batch_norm":
            centred = not layer["center"]
        elif kind == "layer_norm" or (kind == "dense" and (
                layer["activation"] is not None or layer["use_bias"])):
            centred = False
    return False


# ------------------------------------------------------- a spec as Trainer, config, data


def describe(spec: dict[str, Any]) -> str:
    """A one-line summary of what a spec holds (for hypothesis's statistics)."""
    optimizer = spec["train"].get("keras_optimizer") or {}
    kinds = ({"in:" + i["kind"] for i in spec["inputs"]} | {l["layer"] for l in spec["trunk"]}
             | {"out:" + h["kind"] for h in spec["heads"]}
             | ({f"owned:{spec['train']['owned']}"} if spec["train"].get("owned") else set())
             | ({f"noise:{spec['train']['noise']}"} if spec["train"].get("noise") else set())
             | ({"plan:auto"} if spec["train"].get("plan") == "auto" else set())
             | {f"dropout:{l['rate']}" for l in spec["trunk"] if l.get("rate")}
             | {"optimizer:" + k for k in optimizer.get("args", {})}
             | ({"optimizer:" + optimizer["wrapper"]} if optimizer.get("wrapper") else set()))
    return " ".join(sorted(kinds))


def spec_config(spec: dict[str, Any], replicas: int = 1):
    """The config that trains ``spec`` with :class:`SpecTrainer` on ``replicas``
    Mirrored replicas over virtual CPU devices (one device for 1)."""
    from tests.support import toy
    from trainer import config as config_lib

    train = spec["train"]
    config = config_lib.get_config()
    config.trainer = f"{__name__}:SpecTrainer"
    config.seed = spec["seed"]
    config.train.global_batch_size = train["global_batch"]
    config.train.steps = train["steps"]
    config.train.steps_per_loop = train["steps_per_loop"]
    config.train.log_every_steps = train["steps"]
    config.eval.every_steps = 0
    config.optimizer.name = train.get("optimizer", "adam")  # another only to diagnose
    config.optimizer.learning_rate = train["learning_rate"]
    config.perf.plan = train.get("plan", "fixed")
    if config.perf.plan == "auto":  # measures however short (module docstring)
        config.perf.plan_min_run_s = 0.0
        config.perf.plan_trial_s = 1e-6
        config.perf.plan_rounds = 1
        config.perf.plan_cache = "off"
    config.perf.sparse_reduce = train["sparse_reduce"]
    config.distribute.sync_batch_norm = train.get("sync_batch_norm", False)
    config.telemetry.progress = "off"
    config.distribute.strategy = "one_device"
    config.model.spec = json.dumps(spec, sort_keys=True)
    return toy.on_replicas(config, replicas)


def _data(spec: dict[str, Any]):
    """``(features {name: array}, lengths {name: [n] int32}, labels {name: array})``:
    the spec's examples, drawn from ``spec["seed"]``; variable-length inputs as arrays
    padded to ``max_len`` (after the tokens) with their lengths."""
    import numpy as np

    rng = np.random.default_rng(spec["seed"])
    n = EXAMPLES
    features, lengths = {}, {}
    for i, inp in enumerate(spec["inputs"]):
        name = f"in{i}"
        if inp["kind"] == "dense":
            if inp["dtype"] == "int32":
                features[name] = rng.integers(-3, 4, (n, inp["width"])).astype(np.int32)
            else:
                features[name] = rng.normal(size=(n, inp["width"])).astype(inp["dtype"])
            continue
        length = rng.integers(inp["min_len"], inp["max_len"] + 1, n).astype(np.int32)
        valid = np.arange(inp["max_len"])[None, :] < length[:, None]
        if inp["kind"] == "tokens":
            ids = rng.integers(1, inp["vocab"], (n, inp["max_len"])).astype(np.int32)
            features[name] = np.where(valid, ids, 0).astype(np.int32)
        else:
            words = np.array([f"w{k}" for k in range(inp["vocab"])] + ["unknown"])
            picks = rng.integers(0, inp["vocab"], (n, inp["max_len"]))
            picks = np.where(rng.random((n, inp["max_len"])) < inp["oov"], inp["vocab"], picks)
            features[name] = np.where(valid, words[picks], "")
        lengths[name] = length
    labels = {}
    for i, head in enumerate(spec["heads"]):
        if head["kind"] == "class":
            labels[f"out{i}"] = rng.integers(0, head["classes"], n).astype(np.int32)
        else:
            labels[f"out{i}"] = rng.normal(size=(n, head["width"])).astype(np.float32)
    return features, lengths, labels


def train_dataset(spec: dict[str, Any], per_replica_batch: int):
    """The spec's batches of ``per_replica_batch`` examples, repeated: ``(features,
    labels)``, each a dict or (one input / output, not "dict_*") a tensor."""
    import tensorflow as tf

    features, lengths, labels = _data(spec)
    inputs = {f"in{i}": inp for i, inp in enumerate(spec["inputs"])}

    def shape(feature_dict, length_dict, label_dict):
        out = {}
        for name, value in feature_dict.items():
            inp = inputs[name]
            if inp["kind"] == "dense":
                out[name] = value
            elif inp["padding"] == "batch":
                out[name] = value[:length_dict[name]]  # padded_batch pads it again
            elif inp["padding"] == "pre":
                out[name] = tf.roll(value, inp["max_len"] - length_dict[name], axis=0)
            else:
                out[name] = value
        x = out if spec["dict_inputs"] else out["in0"]
        y = label_dict if spec["dict_outputs"] else label_dict["out0"]
        return x, y

    dataset = tf.data.Dataset.from_tensor_slices((features, lengths, labels)).map(shape)
    return dataset.repeat().padded_batch(per_replica_batch, drop_remainder=True)


def build_model(spec: dict[str, Any]):
    """The spec's Keras model (functional)."""
    import keras

    inputs, branches = {}, []
    for i, inp in enumerate(spec["inputs"]):
        name = f"in{i}"
        if inp["kind"] == "dense":
            x = keras.Input((inp["width"],), dtype=inp["dtype"], name=name)
            inputs[name] = x
            branches.append(keras.layers.Dense(inp["units"], name=f"{name}_dense",
                                               use_bias=inp.get("use_bias", True))(x)
                            if inp["units"] else keras.ops.cast(x, "float32"))
            continue
        length = None if inp["padding"] == "batch" else inp["max_len"]
        if inp["kind"] == "tokens":
            x = keras.Input((length,), dtype="int32", name=name)
            ids, vocab = x, inp["vocab"]
        else:
            x = keras.Input((length,), dtype="string", name=name)
            words = [f"w{k}" for k in range(inp["vocab"])]
            ids = keras.layers.StringLookup(vocabulary=words, mask_token="",
                                            name=f"{name}_lookup")(x)
            vocab = inp["vocab"] + 2  # the mask (0) and one OOV index
        inputs[name] = x
        embedding = keras.layers.Embedding(vocab, inp["dim"], mask_zero=True,
                                           name=f"{name}_embedding")
        embedding.trainable = inp.get("trainable", True)
        branches.append(keras.layers.GlobalAveragePooling1D(name=f"{name}_mean")(
            embedding(ids)))
    h = branches[0] if len(branches) == 1 else keras.layers.Concatenate()(branches)
    for j, layer in enumerate(spec["trunk"]):
        h = _trunk_layer_of(layer, f"trunk{j}")(h)
    outputs = {}
    for i, head in enumerate(spec["heads"]):
        width = head["classes"] if head["kind"] == "class" else head["width"]
        outputs[f"out{i}"] = keras.layers.Dense(width, name=f"out{i}")(h)
    model_inputs = inputs if spec["dict_inputs"] else inputs["in0"]
    model_outputs = outputs if spec["dict_outputs"] else outputs["out0"]
    return keras.Model(model_inputs, model_outputs)


def _regularizer(spec):
    import keras

    return None if spec is None else keras.regularizers.L1L2(spec["l1"], spec["l2"])


def _trunk_layer_of(layer: dict[str, Any], name: str):
    import keras

    kind = layer["layer"]
    if kind == "dense":
        dense = keras.layers.Dense(
            layer["units"], activation=layer["activation"], use_bias=layer["use_bias"],
            kernel_regularizer=_regularizer(layer["kernel_regularizer"]),
            activity_regularizer=_regularizer(layer["activity_regularizer"]), name=name)
        dense.trainable = layer["trainable"]
        return dense
    if kind == "batch_norm":
        return keras.layers.BatchNormalization(
            synchronized=layer.get("synchronized", True), momentum=layer["momentum"],
            center=layer["center"], scale=layer["scale"], name=name)
    if kind == "running_mean":
        from tests.support import toy

        return toy.RunningMean(name=name)
    if kind == "dropout":
        return keras.layers.Dropout(layer.get("rate", 0.0), name=name)
    if kind == "add_loss":
        return _square_penalty()(layer["coef"], name=name)
    if kind == "layer_norm":
        return keras.layers.LayerNormalization(center=layer.get("center", True), name=name)
    raise ValueError(f"unknown trunk layer {kind!r}")


_PENALTY = None


def _square_penalty():
    """``SquarePenalty(coef)``: passes its input through and ``add_loss``es
    ``coef * mean(x**2)`` (defined on first use: this module imports no Keras at import)."""
    global _PENALTY
    if _PENALTY is None:
        import keras
        from keras import ops

        class SquarePenalty(keras.layers.Layer):
            def __init__(self, coef: float, **kwargs):
                super().__init__(**kwargs)
                self.coef = coef

            def call(self, x):
                self.add_loss(self.coef * ops.mean(ops.square(x)))
                return x

        _PENALTY = SquarePenalty
    return _PENALTY


def per_example_loss(spec: dict[str, Any], labels, outputs):
    """The per-example loss: the sum over the heads (module docstring)."""
    import keras
    import tensorflow as tf

    if not spec["dict_outputs"]:
        labels, outputs = {"out0": labels}, {"out0": outputs}
    total = 0.0
    for i, head in enumerate(spec["heads"]):
        name = f"out{i}"
        out = tf.cast(outputs[name], tf.float32)
        if head["kind"] == "class":
            total += keras.losses.sparse_categorical_crossentropy(labels[name], out,
                                                                  from_logits=True)
        else:
            total += tf.reduce_mean(tf.square(out - labels[name]), axis=-1)
    return total


def _trainer_class():
    import keras
    import tensorflow as tf

    import trainer

    class SpecTrainer(trainer.Trainer):
        """Trains the spec in ``config.model.spec`` (JSON)."""

        @property
        def spec(self) -> dict[str, Any]:
            return json.loads(self.config.model.spec)

        def build_model(self):
            owned = self.spec["train"].get("owned")
            if owned == "tf":
                self.log_temp = tf.Variable(0.0, trainable=True)
            elif owned == "keras":
                self.log_temp = keras.Variable(0.0)
            elif owned == "nested":
                self.temps = {"scale": [tf.Variable(0.0)], "shift": keras.Variable(0.0)}
            if self.spec["train"].get("noise") == "seed_generator":
                self.noise = keras.random.SeedGenerator(self.spec["seed"])
            model = build_model(self.spec)
            if self.spec["train"].get("step") != "model_step":
                return model

            class GuideStepModel(keras.Model):  # the Keras guide's own step
                def train_step(self, data):
                    raise AssertionError("the Trainer never calls a model's train_step")

            return GuideStepModel(inputs=model.inputs, outputs=model.outputs)

        def build_optimizer(self):
            optimizer = self.spec["train"].get("keras_optimizer")
            if optimizer is None:
                return super().build_optimizer()
            adam = keras.optimizers.Adam(self.config.optimizer.learning_rate,
                                         **optimizer["args"])
            return (keras.optimizers.LossScaleOptimizer(adam)
                    if optimizer["wrapper"] == "loss_scale" else adam)

        def owned_transform(self, outputs):
            """Every head's outputs times (1 + the spec's SeedGenerator noise), exp(the
            learnable log-temperature) and (1 + the learnable shift) (the spec's "noise"
            and "owned" variables; none: unchanged)."""
            if self.spec["train"].get("noise") == "seed_generator":
                outputs = tf.nest.map_structure(lambda out: tf.cast(out, tf.float32) * (
                    1.0 + 0.1 * keras.random.normal(tf.shape(out), seed=self.noise)), outputs)
            owned = self.spec["train"].get("owned")
            if owned is None:
                return outputs
            scale, shift = ((self.temps["scale"][0], self.temps["shift"]) if owned == "nested"
                            else (self.log_temp, 0.0))
            return tf.nest.map_structure(
                lambda out: tf.cast(out, tf.float32) * tf.exp(scale) * (1.0 + shift), outputs)

        def build_train_dataset(self, ctx):
            return train_dataset(
                self.spec, ctx.get_per_replica_batch_size(self.config.train.global_batch_size))

        def compute_loss(self, batch, outputs):
            return per_example_loss(self.spec, batch[1], self.owned_transform(outputs))

        def train_step(self, batch):
            step = self.spec["train"].get("step", "default")
            if step in ("default", "model_step"):
                return self.steps.train(batch)
            with tf.GradientTape() as tape:
                outputs = self.model(batch[0], training=True)
                loss = self.compute_loss(batch, outputs)
                if step == "gather":  # a term over every example of the global batch
                    first = tf.cast(tf.nest.flatten(outputs)[0], tf.float32)
                    loss += 0.01 * tf.reduce_mean(tf.square(self.all_gather(first)))
                if step == "direct_apply":
                    loss = tf.reduce_mean(loss)
            if step != "direct_apply":
                return {"loss": self.apply_gradients(tape, loss)}
            variables = self.model.trainable_variables
            self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return {"loss": loss}

    SpecTrainer.__module__ = __name__
    return SpecTrainer


def __getattr__(name: str):
    # ``config.trainer = "tests.properties.model_specs:SpecTrainer"`` resolves here; the
    # class is made on first use so that importing the strategies imports no TensorFlow.
    if name == "SpecTrainer":
        cls = _trainer_class()
        globals()["SpecTrainer"] = cls
        return cls
    raise AttributeError(name)


def train_spec(spec: dict[str, Any], replicas: int) -> dict[str, Any]:
    """Trains ``spec`` on ``replicas`` replicas in this process: ``{"names", "initial",
    "final", "warnings", "resumed", "pinned", "plan"}`` (the values of :func:`_values`
    before and after training, named; the warnings the Trainer logged while it was
    built; ``resumed``: for a spec that draws random numbers, the final values of a run
    stopped after half its steps and resumed by a new Trainer, else None; for plan
    ``"auto"``: ``plan``, the run's plan event fields, and ``pinned``, the final values
    of the spec with the kept plan pinned from the start (``perf.plan="fixed"``), which
    the resumed run also pins; else both None)."""
    import logging

    from tests.properties import model_specs
    from tests.support.toy import pinned

    class Warnings(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines: list[str] = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    config = spec_config(spec, replicas)
    warnings = Warnings()
    logging.getLogger("absl").addHandler(warnings)
    try:
        t = model_specs.SpecTrainer(config)
    finally:
        logging.getLogger("absl").removeHandler(warnings)
    assert t.strategy.num_replicas_in_sync == replicas, t.strategy
    names = ([w.path for w in t.model.weights]
             + [f"owned/{path}" for path, _ in t.gradients.owned]
             + (["seed_generator/state"] if hasattr(t, "noise") else []))
    out = {"names": names, "initial": _values(t), "warnings": warnings.lines,
           "resumed": None, "pinned": None, "plan": None}
    t.fit()
    out["final"] = _values(t)
    overrides = {}
    if config.perf.plan == "auto":
        out["plan"] = t.driver.planner.record
        overrides = pinned(out["plan"]["chosen"])
        kept = spec_config(spec, replicas)
        kept.update_from_flattened_dict(overrides)
        t = model_specs.SpecTrainer(kept)
        t.fit()
        out["pinned"] = _values(t)
    if draws_random_numbers(spec):
        out["resumed"] = _resumed(spec, replicas, overrides)
    return out


def _values(t) -> list:
    """The model's weights, the variables the Trainer holds (compared as weights), then
    the state of the Trainer's SeedGenerator (the spec's noise) if any."""
    import numpy as np

    return ([np.asarray(w) for w in t.model.get_weights()]
            + [np.asarray(v.numpy()) for _, v in t.gradients.owned]
            + ([np.array(t.noise.state)] if hasattr(t, "noise") else []))


def _resumed(spec: dict[str, Any], replicas: int, overrides: dict[str, Any]) -> list:
    """The final values of ``spec`` (with the config ``overrides``) trained to half its
    steps in a fresh workdir, then resumed there by a new Trainer to its last step."""
    import shutil
    import tempfile

    from tests.properties import model_specs

    def config(steps: int):
        c = spec_config(spec, replicas)
        c.update_from_flattened_dict(overrides)
        c.train.steps = steps
        return c

    workdir = tempfile.mkdtemp(prefix="spec-resume-")
    try:
        model_specs.SpecTrainer(config(spec["train"]["steps"] // 2), workdir).fit()
        t = model_specs.SpecTrainer(config(spec["train"]["steps"]), workdir)
        t.fit()
        return _values(t)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
