"""distribute.grad_compression: the dense gradients' all-reduce in bfloat16 / float16.

tests/step/run_grad_compression.py trains each case on 1 and on 2 replicas (virtual CPU
devices, one process per replica count, both started by one module fixture). On 2
replicas a compressed run ends close to the exact one, within what 16-bit sums allow,
but not bit-equal to it (the cast happens); on 1 replica nothing is communicated and it
is bit-equal. A float16 sum that overflows (the gradients reduced are the loss-scaled
ones) skips the step and halves the loss scale, as any overflow under mixed_float16.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tests.support.helpers import max_abs_diff, run_at_once, saved_run

# Compressed vs exact after 20 SGD steps: max |dw| / the model's largest |w|. Measured
# about 1e-3 for bf16 (8 significant bits) and 1e-4 for fp16 (11); float32 rounding
# noise is below 1e-6.
RTOL = 1e-2
CASES = {"bf16": "none", "mixed_fp16": "mixed_none"}  # compressed run: its exact reference


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{replicas: {"weights": npz dict, "facts": dict, "log": str}} for 1 and 2."""
    out = tmp_path_factory.mktemp("grad_compression")
    done = run_at_once({n: [sys.executable, "-m", "tests.step.run_grad_compression",
                            "--replicas", str(n), "--out", str(out / f"{n}.npz")]
                        for n in (1, 2)}, timeout=600)
    found = {}
    for n, proc in done.items():
        assert proc.returncode == 0, f"{n}-replica run failed:\n{proc.stdout[-4000:]}"
        weights = dict(np.load(out / f"{n}.npz"))
        found[n] = {"facts": json.loads(str(weights.pop("facts"))), "weights": weights,
                    "log": proc.stdout}
    return found


def weights(runs: dict, replicas: int, run: str) -> list[np.ndarray]:
    return saved_run(runs[replicas]["weights"], run)


@pytest.mark.parametrize("compressed", CASES)
def test_two_replicas_train_close_to_the_exact_sum_but_not_bit_equal(runs, compressed):
    exact, lossy = weights(runs, 2, CASES[compressed]), weights(runs, 2, compressed)
    scale = max(float(np.max(np.abs(w))) for w in exact)
    assert max_abs_diff(exact, lossy) / scale <= RTOL
    assert not all(np.array_equal(a, b) for a, b in zip(exact, lossy)), \
        f"{compressed} on 2 replicas is bit-equal to the exact run: nothing was cast"


@pytest.mark.parametrize("compressed", [*CASES, "overflow_fp16", "bf16_default_strategy"])
def test_one_replica_casts_nothing(runs, compressed):
    reference = {**CASES, "overflow_fp16": "overflow_none",
                 "bf16_default_strategy": "none"}[compressed]
    for a, b in zip(weights(runs, 1, reference), weights(runs, 1, compressed)):
        np.testing.assert_array_equal(a, b)


def test_a_float16_sum_that_overflows_skips_the_step_and_lowers_the_loss_scale(runs):
    facts = runs[2]["facts"]
    # Exact: 2 * 2**15 = 2**16 is finite in float32, both steps apply at scale 2**16.
    assert facts["overflow_none"] == {"skipped_steps": 0, "loss_scale": 2.0 ** 16,
                                      "step": 2, "finite": True}
    # float16: each replica's 2**15 fits, their sum does not (max 65504): step 1 is
    # skipped on every replica and the scale halved; step 2 sums to 2**15 and applies.
    assert facts["overflow_fp16"] == {"skipped_steps": 1, "loss_scale": 2.0 ** 15,
                                      "step": 2, "finite": True}
    one_update = weights(runs, 2, "overflow_fp16")[0]
    np.testing.assert_allclose(one_update, -0.1)  # SGD lr 0.1 on an unscaled gradient of 1
    assert runs[1]["facts"]["overflow_fp16"]["skipped_steps"] == 0  # 1 replica: no cast


def test_the_trace_logs_what_is_compressed(runs):
    two, one = runs[2]["log"], runs[1]["log"]
    for kind, cast in (("bf16", "bfloat16"), ("fp16", "float16")):
        assert (f"distribute.grad_compression={kind}: 4 dense gradients are all-reduced in "
                f"{cast} over 2 replicas (lossy)") in two
    assert two.count("grad_compression=fp16: 1 dense gradients") == 1  # one line per trace
    assert "distribute.grad_compression=bf16: 1 replica, nothing is communicated, " \
           "nothing is cast." in one
    assert "grad_compression=none" not in one + two
