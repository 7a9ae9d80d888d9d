"""Properties of the loop's cadences and controls over drawn configs (hypothesis).

One replica in this process; two Mirrored replicas in one subprocess that runs its own
examples (one replica count per process), started with the module so that both run at
once. Profiles, example counts and how to replay a failure: tests/README.md.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest
from hypothesis import example, given, settings

from tests.conftest import collected
from tests.support.helpers import REPO, subprocess_env
from tests.properties import checks, profiles, strategies

#: examples per property in the ``ci`` profile (scaled by the profile)
RUN_EXAMPLES, RESUME_EXAMPLES = 12, 4


@strategies.written_runs_first(replicas=1)
@settings(max_examples=profiles.examples(RUN_EXAMPLES))
@given(case=strategies.run_cases(replicas=1))
def test_a_run_ends_as_its_cadences_and_controls_promise(case):
    checks.check_run(case)


@example(case=strategies.written_case(
    {"perf.grad_accum_steps": 2, "train.steps": 8, "train.steps_per_loop": 3,
     "eval.every_steps": 3, "checkpoint.every_steps": 2, "optimizer.ema_decay": 0.5,
     "train.on_nonfinite": "skip"}, poison_step=5, stop_at=3))
@settings(max_examples=profiles.examples(RESUME_EXAMPLES))
@given(case=strategies.resume_cases(replicas=1))
def test_a_run_stopped_anywhere_resumes_bit_exactly(case):
    checks.check_resume(case)


TWO_REPLICAS = "test_the_properties_hold_on_two_mirrored_replicas"


@pytest.fixture(scope="module", autouse=True)
def two_replica_run(request):
    """The two-replica subprocess, started before the first in-process example so it
    runs alongside them (the in-process examples keep about one core busy); only when
    its test was collected. The test waits for it."""
    if not collected(request, TWO_REPLICAS):
        yield None
        return
    env = subprocess_env()
    env[profiles.PROFILE_ENV] = settings.get_current_profile_name()
    # A file, not a pipe: nobody reads before the test, and a full pipe stops the run.
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.properties.run_replicas",
                                 "--replicas", "2"], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, text=True)
        yield proc, log
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_properties_hold_on_two_mirrored_replicas(two_replica_run):
    proc, log = two_replica_run
    proc.wait(timeout=900)
    log.seek(0)
    output = log.read()
    assert proc.returncode == 0, output[-6000:]
