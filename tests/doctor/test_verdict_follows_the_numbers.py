"""The doctor's verdict on hand-made reports: the bound is the slower part timed alone,
every number in the text is one of the table's, and file sharding is offered only to an
input that may read files. Also which pipelines the doctor sees reading files."""

from __future__ import annotations

import re

import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.doctor import measure
from trainer.doctor import report as doctor_report


def _report(run, probe, step, device="CPU", **input_facts):
    return {"config": {"device": device, "host_cores": 2},
            "baseline": {"examples_per_s": run},
            "input": {"examples_per_s": probe, **input_facts},
            "compute": {"examples_per_s": step}}


def _numbers(text):
    return {float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*(?:\.\d+)?(?= ex/s|\))", text)}


def test_pipeline_faster_than_the_step_is_compute_bound_with_the_contention_advice():
    """The digits demo on 2 shared CPU cores: pipeline 132k, step 109k, run 80k."""
    result = doctor_report.verdict(_report(80_000, 132_000, 109_000))
    assert result["kind"] == "compute-bound"
    assert "input" not in result["text"].split(":")[0]
    assert "132,000 ex/s" in result["text"] and "109,000 ex/s" in result["text"]
    assert "1.21x the step" in result["text"] and "the run gets 80,000" in result["text"]
    overhead = [a for a in result["advice"] if "well below both" in a]
    assert len(overhead) == 1, result["advice"]
    for number in ("80,000", "132,000", "109,000", "raise train.steps_per_loop",
                   "compete for the same 2 cores"):
        assert number in overhead[0]
    assert not any("file sharding" in a for a in result["advice"])


def test_no_core_contention_advice_when_the_step_runs_on_an_accelerator():
    result = doctor_report.verdict(_report(80_000, 132_000, 109_000, device="GPU"))
    overhead = [a for a in result["advice"] if "well below both" in a]
    assert overhead and "cores" not in overhead[0]


@pytest.mark.parametrize("probe, narrowly", [(50_000, False), (100_000, True)])
def test_pipeline_slower_than_the_step_is_input_bound(probe, narrowly):
    result = doctor_report.verdict(_report(probe, probe, 109_000, reads_files=True))
    assert result["kind"] == "input-bound"
    assert result["text"].startswith("input-bound (narrowly)" if narrowly else "input-bound:")
    assert f"{probe:,} ex/s" in result["text"] and "109,000 ex/s" in result["text"]
    assert any(a.startswith("3. file sharding:") for a in result["advice"])


def test_a_run_faster_than_its_probe_counts_as_the_pipeline_rate_and_says_so():
    result = doctor_report.verdict(_report(60_000, 50_000, 109_000))
    assert result["kind"] == "input-bound"
    assert "at least the run's 60,000 ex/s" in result["text"]
    assert "timed alone 50,000" in result["text"]


@pytest.mark.parametrize("reads_files, remedies", [
    (False, ["1. parallelism", "2. cache", "3. tf.data service"]),
    (True, ["1. parallelism", "2. cache", "3. file sharding", "4. tf.data service"]),
    (None, ["1. parallelism", "2. cache", "3. file sharding (if the input reads files)",
            "4. tf.data service"]),
])
def test_file_sharding_is_offered_only_to_an_input_that_may_read_files(reads_files, remedies):
    advice = doctor_report.input_remedies({"examples_per_s": 1.0, "reads_files": reads_files})
    assert [a.split(":", 1)[0] for a in advice] == remedies


def test_reading_slower_than_the_whole_pipeline_is_not_called_its_share():
    """A pipeline that caches after reading: reading alone is timed slower than it."""
    advice = doctor_report.input_remedies({"examples_per_s": 127_000.0, "read_share": 1.0,
                                           "read_examples_per_s": 17_000.0})
    assert "17,000 ex/s) is slower than the whole pipeline (127,000 ex/s)" in advice[0]
    assert not any("of the input time" in a or "dominates" in a for a in advice)


@settings(max_examples=300, deadline=None)
@given(run=st.floats(1, 1e6), probe=st.floats(1, 1e6), step=st.floats(1, 1e6))
def test_every_verdict_agrees_with_its_numbers(run, probe, step):
    result = doctor_report.verdict(_report(run, probe, step, reads_files=False))
    feed = max(run, probe)
    assert (result["kind"] == "input-bound") == (feed < step)
    assert result["text"].startswith("input-bound (narrowly)") == (0.85 * step <= feed < step)
    well_below = [a for a in result["advice"] if "well below both" in a]
    assert bool(well_below) == (run < 0.8 * min(feed, step))
    shown = {float(f"{x:.0f}") for x in (run, probe, step)}
    for sentence in [result["text"], *well_below]:
        assert _numbers(sentence) <= shown, sentence


def _in_memory(ctx):
    return tf.data.Dataset.from_tensor_slices(tf.range(8)).map(lambda x: x * 2).batch(2)


def _eager_only(ctx):
    size = int(tf.size(tf.range(8)).numpy())  # eager-only: fails while traced
    return tf.data.Dataset.range(size)


def test_reads_files_sees_readers_nested_in_interleave(tmp_path):
    paths = []
    for i in range(2):
        paths.append(str(tmp_path / f"part-{i}.tfrecord"))
        with tf.io.TFRecordWriter(paths[-1]) as writer:
            writer.write(b"example")

    def from_files(ctx):
        return tf.data.Dataset.from_tensor_slices(paths).interleave(
            tf.data.TFRecordDataset, num_parallel_calls=tf.data.AUTOTUNE).batch(2)

    assert measure.reads_files(from_files) is True
    assert measure.reads_files(_in_memory) is False
    assert measure.reads_files(_eager_only) is None
