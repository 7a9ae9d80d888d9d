"""distribute.grad_pack_bytes reaches TensorFlow's collective all-reduce: on 2 real
workers (MultiWorkerMirroredStrategy, the launcher) the gradient path's all-reduce is
one collective without packs and several with, and the sums are the same values. With
distribute.grad_compression=bf16 the gradients' packs cross as bfloat16 and the scalar in
one float32 collective of its own, exact.
Training to the weights of one process with packs: tests/cluster/test_cross_host_training.py."""

from __future__ import annotations

import json
import re

import numpy as np

from tests.launch_helpers.running import Launch

EXPECTED = [100900.0, 19.0, 1603600.0, 3.0]  # run_gradient_packs' sums over 2 workers


def reduce_on_two_workers(pack_bytes: int, compression: str = "none") -> list[dict]:
    run = Launch("launch.multiworker", ["--workers", "2", "--module",
                                        "tests.step.run_gradient_packs",
                                        "--pack_bytes", str(pack_bytes),
                                        "--compression", compression])
    assert run.finish(240) == 0, run.output[-4000:]
    found = [json.loads(m) for m in re.findall(r"^\[worker:\d\] (\{.*\})$", run.output, re.M)]
    assert len(found) == 2, run.output[-4000:]
    return found


def test_packs_split_the_all_reduce_and_keep_its_sums():
    batched, packed = reduce_on_two_workers(0), reduce_on_two_workers(4096)
    assert [w["collectives"] for w in batched] == [1, 1]
    assert all(w["collectives"] >= 2 for w in packed), packed
    for worker in batched + packed:
        np.testing.assert_array_equal(worker["values"], EXPECTED)


def test_compressed_packs_cross_in_bfloat16_and_the_scalar_stays_exact():
    for worker in reduce_on_two_workers(4096, "bf16"):
        dtypes = worker["dtypes"]
        assert dtypes.count("float32") == 1 and dtypes.count("bfloat16") >= 2, dtypes
        assert worker["values"][-1] == EXPECTED[-1]  # the scalar: float32, exact
        np.testing.assert_allclose(worker["values"][:-1], EXPECTED[:-1], rtol=1e-2)
        assert worker["values"][:-1] != EXPECTED[:-1]  # the gradients were cast


def test_trainers_differing_only_in_the_gradient_path_share_one_strategy():
    """Pack size and compression shape the step, not the devices: a second Trainer in
    the process that changes only them gets the first one's strategy (two Mirrored
    strategies over the same devices would clash)."""
    from trainer import config as config_lib
    from trainer.distribution import strategies

    config = config_lib.get_config()
    config.distribute.strategy = "one_device"
    first = strategies.build_strategy(config.distribute)
    config.distribute.grad_pack_bytes = 4 << 20
    config.distribute.grad_compression = "bf16"
    assert strategies.build_strategy(config.distribute) is first
    config.distribute.memory_growth = True  # a device setting: another strategy
    assert strategies.build_strategy(config.distribute) is not first
