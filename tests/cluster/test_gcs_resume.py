"""The spot-VM case with the workdir in a bucket: a run stopped by SIGTERM saves to the
bucket and exits 143, and a NEW host with empty local disks resumes it exactly, while a
continuous evaluator on another host follows its checkpoints in the bucket.

The launcher tests' digits config (``tests/launch_helpers/weights_config.py``: 30 steps
of 5 per loop, final weights written to the workdir by ``WeightsTrainer``) with a
checkpoint every 10 steps, ``--workdir=gs://...`` in the GCS emulator
(tests/cluster/gcs.py). The runs log every step (so a loop is one step), and the
interrupted run's input sleeps 1 s per batch from batch 10 on (``LAUNCH_TEST_SLOW_FROM``,
only in a run that finds no marker of an earlier one): SIGTERM is sent when its step-12
line is printed, so the run stops at a loop end past the step-10 checkpoint and before
step 20's, saving a checkpoint off the every-10 schedule. The reference is the same run
uninterrupted; resumed from the checkpoint, with the data position it holds, the final
weights match it to 1e-5.
"""

from __future__ import annotations

import json
import re
import shutil
import signal

from tests.cluster.hosts import Host
from tests.cluster.runs import CONFIG, RUN_S, SLOW, STEPS, bucket_url, fetch, start, trainer_argv
from tests.support.helpers import load_weights, max_abs_diff

EVERY_10 = "--config.checkpoint.every_steps=10"
EVERY_STEP = "--config.train.log_every_steps=1"  # a progress line (and a loop end) per step
SIGNALLED_AT = 12  # the step whose line triggers SIGTERM
# No input-wait probe in the slowed run: its own copy of the input would read the slowed
# batches for seconds, during which the run's prefetch gets ahead and the loop after
# step 10 ends before the signal (seen once: the checkpoint of step 20, not 15).
NO_PROBES = "--config.telemetry.probe_every_windows=0"
WEIGHTS = "weights-local-0.npz"


def empty_local_disks(host: Host) -> None:
    """``host`` as a new machine: its HOME, TFDS data and scratch directories empty."""
    for directory in (host.home, host.tfds_data_dir, host.scratch):
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)


def test_a_preempted_run_resumes_exactly_on_a_new_host_and_the_evaluator_follows(
        cluster, gcs, tmp_path):
    h0, h1 = cluster.hosts[:2]
    port = cluster.ports()[0]
    run_url, reference_url = bucket_url(f"resume-{port}"), bucket_url(f"resume-ref-{port}")
    argv = trainer_argv(run_url, EVERY_10, EVERY_STEP, NO_PROBES, config=CONFIG)
    reference = start(cluster, gcs, h1, trainer_argv(reference_url, EVERY_10, config=CONFIG))
    interrupted = start(cluster, gcs, h0, argv, env=SLOW)
    interrupted.wait_for(rf"^step {SIGNALLED_AT}/{STEPS}", RUN_S)
    interrupted.proc.send_signal(signal.SIGTERM)
    assert interrupted.finish(RUN_S) == 143, interrupted.output[-6000:]
    saved = int(re.findall(r"checkpoint of step (\d+) ->", interrupted.output)[-1])
    # The end of the loop (one step) the signal reached, off the every-10 schedule: the
    # preemption's own save. (The steps after 12 take 1 s each: the signal is handled long
    # before step 20.)
    assert SIGNALLED_AT <= saved < 20, interrupted.output[-3000:]
    assert reference.finish(RUN_S) == 0, reference.output[-6000:]

    empty_local_disks(h1)
    resumed = start(cluster, gcs, h1, argv)
    evaluator = start(cluster, gcs, h0, [*argv, "--mode=continuous_eval",
                                         f"--eval_timeout_s={RUN_S}"])
    assert resumed.finish(RUN_S) == 0, resumed.output[-6000:]
    assert f"resumed from step {saved} (" in resumed.output, resumed.output[-6000:]
    assert evaluator.finish(RUN_S) == 0, evaluator.output[-6000:]
    evaluated = [int(s) for s in re.findall(r"eval  step (\d+):", evaluator.output)]
    assert evaluated and evaluated[-1] == STEPS and evaluated == sorted(set(evaluated)), (
        evaluator.output[-6000:])

    names = fetch(cluster, gcs, f"resume-{port}", tmp_path / "run")
    fetch(cluster, gcs, f"resume-ref-{port}", tmp_path / "reference")
    diff = max_abs_diff(load_weights(tmp_path / "reference" / WEIGHTS),
                        load_weights(tmp_path / "run" / WEIGHTS))
    print(f"\n[measured] resumed on a new host from step {saved}: max|dw| vs uninterrupted "
          f"{diff:.2e}")
    assert diff <= 1e-5
    assert f"checkpoints/{STEPS}/commit_success.txt" in names, names
    records = [json.loads(line)
               for line in (tmp_path / "run" / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("kind") == "eval"][-1] == STEPS, records
