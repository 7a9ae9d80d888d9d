"""Model and hardware FLOPs per example, achieved TFLOPS, MFU and HFU (trainer/flops.py)
on the digits MLP."""

from __future__ import annotations

import json

import keras
import pytest

from models import digits
from models.configs import digits as digits_config
from tests.conftest import early_main
from trainer.telemetry import flops



def _config(**overrides):
    config = digits_config.get_config()
    config.distribute.strategy = "one_device"
    config.train.steps, config.train.steps_per_loop, config.train.log_every_steps = 20, 5, 10
    config.eval.every_steps = 0
    config.telemetry.progress = "off"
    config.telemetry.probe_every_windows = 0
    config.update_from_flattened_dict(overrides)
    return config


def _fitted(**overrides) -> digits.DigitsTrainer:
    """A digits Trainer after one 5-step loop (no workdir)."""
    t = digits.DigitsTrainer(_config(**{"train.steps": 5, "train.log_every_steps": 5,
                                        **overrides}))
    t.fit()
    return t


def _dense_macs(model: keras.Model) -> list[int]:
    """Multiply-adds per example of each Dense layer, in order."""
    return [int(layer.kernel.shape[0] * layer.kernel.shape[1])
            for layer in model.layers if isinstance(layer, keras.layers.Dense)]


mirrored_main = early_main(
    "mirrored_main", "test_the_estimate_per_example_is_the_same_on_two_mirrored_replicas",
    "--config.distribute.virtual_devices=2", "--config.distribute.strategy=mirrored",
    "--config.train.steps=10", "--config.train.log_every_steps=10",
    "--config.eval.every_steps=0", "--config.telemetry.peak_tflops=2.0")


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """20 steps of the digits MLP with a workdir and a given peak (so MFU is reported)."""
    workdir = tmp_path_factory.mktemp("flops")
    t = digits.DigitsTrainer(_config(**{"telemetry.peak_tflops": 2.0}), str(workdir))
    t.fit()
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return t, [r for r in map(json.loads, lines) if r["kind"] == "train"]


def test_digits_flops_estimate_is_close_to_the_analytic_count(digits_run):
    t, records = digits_run
    macs = _dense_macs(t.model)
    estimate = records[0]["train/flops_per_example"]
    analytic = 3 * 2 * sum(macs)  # forward + 2x for the backward pass (model FLOPs)
    hardware = records[0]["train/hardware_flops_per_example"]
    # The step's graph does not compute the gradient of the input data: the first
    # layer's backward pass is its weight gradient only.
    executed_matmuls = 2 * sum(macs) + 2 * sum(macs) + 2 * sum(macs[1:])
    print(f"digits MLP: model FLOPs {estimate:.0f}/example, analytic 3x2xMACs {analytic}, "
          f"ratio {estimate / analytic:.4f}; hardware FLOPs {hardware:.0f}, matmuls the "
          f"graph runs {executed_matmuls}, ratio {hardware / executed_matmuls:.3f}")
    assert abs(estimate / analytic - 1) <= 0.25
    # Above the matmuls only by the forward's bias adds and activations (3x them).
    assert analytic <= estimate <= 1.02 * analytic
    assert executed_matmuls <= hardware <= 1.25 * executed_matmuls
    assert hardware < estimate


def test_records_hold_tflops_mfu_and_hfu_from_the_window_throughput(digits_run):
    t, records = digits_run
    assert [r["step"] for r in records] == [10, 20]
    replicas = t.strategy.num_replicas_in_sync
    for record in records:
        for key in ("train/flops_per_example", "train/hardware_flops_per_example"):
            assert record[key] == records[0][key]
        tflops = record["train/flops_per_example"] * record["perf/examples_per_s"] / 1e12
        assert record["train/tflops"] == pytest.approx(tflops, rel=1e-9)
        assert record["train/mfu"] == pytest.approx(tflops / (2.0 * replicas), rel=1e-9)
        hardware_tflops = (record["train/hardware_flops_per_example"]
                           * record["perf/examples_per_s"] / 1e12)
        assert record["train/hfu"] == pytest.approx(hardware_tflops / (2.0 * replicas),
                                                    rel=1e-9)


@pytest.mark.parametrize("overrides", [{"perf.jit_compile": True},
                                       {"train.on_nonfinite": "skip"},
                                       {"perf.recompute": True}], ids=str)
def test_model_flops_do_not_depend_on_how_the_step_runs(digits_run, overrides):
    """Model FLOPs are the same under XLA, a skip branch and recomputation; the hardware
    count reads nested functions (the XLA-compiled forward/backward, the tf.cond of the
    update) and counts the recomputed forward pass."""
    _, records = digits_run
    other = _fitted(**overrides)
    assert flops.model_flops_per_example(other.context) == pytest.approx(
        records[0]["train/flops_per_example"], rel=1e-9)
    hardware = flops.hardware_flops_per_example(other.context)
    reference = records[0]["train/hardware_flops_per_example"]
    if overrides == {"perf.recompute": True}:
        assert hardware > 1.2 * reference  # the forward pass runs twice
    else:
        assert hardware == pytest.approx(reference, rel=0.02)


def test_the_counts_do_not_retrace_the_train_loop(digits_run):
    t, records = digits_run
    assert flops.model_flops_per_example(t.context) == records[0]["train/flops_per_example"]
    assert (flops.hardware_flops_per_example(t.context)
            == records[0]["train/hardware_flops_per_example"])
    assert t.driver.loops.train.experimental_get_tracing_count() == 1


def test_cpu_has_no_peak_so_no_mfu_or_hfu():
    assert flops.device_peak_tflops("float32") == ("CPU", None)
    meter = flops.FlopsMeter(_config())
    t = _fitted()
    values = meter.values(t.context, {"perf/examples_per_s": 1000.0})
    assert values["train/flops_per_example"] > 0
    assert values["train/tflops"] == pytest.approx(values["train/flops_per_example"] * 1e-9)
    assert values["train/hardware_flops_per_example"] > 0
    assert values["train/mfu"] is None and values["train/hfu"] is None


def test_peak_table_matches_gpu_names_and_dtypes():
    table = flops.PEAK_TFLOPS
    assert next(k for k in table if k in "NVIDIA H100 PCIe") == "H100 PCIe"
    assert next(k for k in table if k in "NVIDIA H100 80GB HBM3") == "H100"
    assert next(k for k in table if k in "NVIDIA A100-SXM4-40GB") == "A100"
    assert next(k for k in table if k in "NVIDIA L40S") == "L40S"
    assert next(k for k in table if k in "NVIDIA H200") == "H200"
    assert next(k for k in table if k in "NVIDIA H200 NVL") == "H200 NVL"
    assert next(k for k in table if k in "NVIDIA L4") == "L4"
    assert next(k for k in table if k in "Tesla T4") == "T4"
    assert next(k for k in table if k in "v5litepod-8") == "v5litepod"
    assert table["H200"]["bfloat16"] == table["H100"]["bfloat16"] == 989.4
    assert table["A100"]["tf32"] > table["A100"]["float32"]


def test_the_estimate_per_example_is_the_same_on_two_mirrored_replicas(digits_run,
                                                                      mirrored_main):
    """Model FLOPs per example do not depend on the replica count; the loop graph holds
    one step per replica, so the hardware count per example hardly changes."""
    _, records = digits_run
    proc, tmp_path = mirrored_main.result(), mirrored_main.workdir
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "replicas in sync: 2" in proc.stderr
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    record = next(r for r in map(json.loads, lines) if r["kind"] == "train")
    assert record["train/flops_per_example"] == pytest.approx(
        records[0]["train/flops_per_example"], rel=0.01)
    # Slightly more (+3% here): every replica applies the optimizer update to its copy.
    assert record["train/hardware_flops_per_example"] == pytest.approx(
        records[0]["train/hardware_flops_per_example"], rel=0.05)
    assert record["train/mfu"] == pytest.approx(record["train/tflops"] / (2.0 * 2), rel=1e-9)
