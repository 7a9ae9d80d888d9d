"""The digits demo with its workdir in a bucket: everything a local workdir holds is in
``gs://BUCKET/PREFIX`` and reads back with the tools a user would use.

One run (module fixture) of ``python -m trainer.main`` with the demo's config on a
simulated host, ``--workdir=gs://...`` in the GCS emulator (tests/cluster/gcs.py), 60
steps, a checkpoint and an evaluation every 20, ``max_to_keep=2`` and the best 2 by
``eval/accuracy``. The tests read what it left through google-cloud-storage,
TensorBoard's own event reader and ``tf.saved_model.load``, on a host (only the hosts
reach the emulator).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.cluster.gcs import GcsEmulator
from tests.cluster.hosts import SimulatedCluster
from tests.cluster.runs import RUN_S, bucket_url, fetch, start, trainer_argv
from tests.support.helpers import REPO

STEPS, EVERY = 60, 20
FLAGS = [f"--config.train.steps={STEPS}", "--config.train.steps_per_loop=10",
         f"--config.train.log_every_steps={EVERY}", f"--config.checkpoint.every_steps={EVERY}",
         "--config.checkpoint.max_to_keep=2", f"--config.eval.every_steps={EVERY}",
         "--config.checkpoint.best_metric=eval/accuracy"]
# On a host: TensorBoard's reader on the bucket's event files, the best export loaded.
READ_BACK = """
import json, sys
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
workdir = sys.argv[1]
seen = {}
for run in ("train", "eval"):
    events = EventAccumulator(f"{workdir}/{run}", size_guidance={"tensors": 0})
    events.Reload()
    seen[run] = {tag: [e.step for e in events.Tensors(tag)] for tag in events.Tags()["tensors"]}
model = tf.saved_model.load(f"{workdir}/export/best")
seen["export_signatures"] = sorted(model.signatures)
print(json.dumps(seen))
"""


class Run(NamedTuple):
    prefix: str
    output: str
    names: list[str]
    files: Path


@pytest.fixture(scope="module")
def run(simulated_cluster: SimulatedCluster, gcs: GcsEmulator, tmp_path_factory) -> Run:
    prefix = f"workdir-{simulated_cluster.ports()[0]}"
    proc = start(simulated_cluster, gcs, 0, trainer_argv(bucket_url(prefix), *FLAGS))
    assert proc.finish(RUN_S) == 0, proc.output[-6000:]
    files = tmp_path_factory.mktemp("bucket")
    return Run(prefix, proc.output, fetch(simulated_cluster, gcs, prefix, files), files)


def test_the_result_line_names_the_final_checkpoint_in_the_bucket(run):
    result = [line for line in run.output.splitlines() if line.startswith("result: ")]
    assert len(result) == 1, run.output[-3000:]
    assert f"step={STEPS} " in result[0], result
    assert f"checkpoint={bucket_url(run.prefix)}/checkpoints/{STEPS}" in result[0], result
    assert re.search(r"eval/accuracy=0\.\d+", result[0]), result


def test_the_newest_checkpoints_and_the_best_are_kept_committed_with_checksums(run):
    steps = {n.split("/")[1] for n in run.names if n.startswith("checkpoints/") and n.count("/") > 1}
    assert steps == {"40", "60"}, run.names  # max_to_keep=2: step 20 was removed
    best = {n.split("/")[1] for n in run.names if n.startswith("checkpoints_best/") and n.count("/") > 1}
    assert len(best) == 2, run.names
    for step in [f"checkpoints/{s}" for s in steps] + [f"checkpoints_best/{s}" for s in best]:
        assert f"{step}/commit_success.txt" in run.names, (step, run.names)
        assert f"{step}/state/crc32c.json" in run.names, (step, run.names)
        checksums = json.loads((run.files / step / "state" / "crc32c.json").read_text())
        assert checksums, step
    assert not any(".orbax-checkpoint-tmp" in n for n in run.names), run.names


def test_config_json_and_metrics_jsonl_are_in_the_bucket(run):
    config = json.loads((run.files / "config.json").read_text())
    assert config["train"]["steps"] == STEPS and config["trainer"] == "models.digits:DigitsTrainer"
    records = [json.loads(line) for line in (run.files / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if r.get("kind") == "train"]
    assert train_steps and train_steps[-1] == STEPS, records[-3:]
    assert any("eval/accuracy" in r for r in records), records[-3:]


def test_tensorboard_reads_the_events_and_the_best_export_loads_from_the_bucket(
        run, simulated_cluster, gcs):
    result = simulated_cluster.run(0, [sys.executable, "-c", READ_BACK, bucket_url(run.prefix)],
                                   env=gcs.client_env(), timeout=RUN_S)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["train"]["loss"] == [20, 40, 60], seen["train"].keys()
    assert seen["eval"]["accuracy"] == [20, 40, 60], seen["eval"]
    assert "serving_default" in seen["export_signatures"], seen
    best = json.loads((run.files / "export" / "best" / "best.json").read_text())
    assert best["step"] in (20, 40, 60) and 0 < best["accuracy"] <= 1, best


def test_nothing_of_the_run_is_written_to_a_local_gs_directory(run, simulated_cluster):
    for root in (REPO, simulated_cluster.hosts[0].home):
        assert not (root / "gs:").exists(), root
