"""The loop properties on N Mirrored replicas (virtual CPU devices), in this process.

    python -m tests.properties.run_replicas --replicas 2

One process hosts one replica count, so the two-replica examples of
``tests/properties/test_loop_properties.py`` run here, all in one process (tracing,
not process start-up, is what an example costs). The hypothesis profile comes from the
environment (``CI=true``: ``ci``; else ``$TF_TRAINER_HYPOTHESIS_PROFILE``). Exits
non-zero with hypothesis's falsifying example when a property fails.
"""

from __future__ import annotations

import argparse
import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from hypothesis import given, settings  # noqa: E402

from tests.properties import checks, profiles, strategies  # noqa: E402

#: examples per property on two replicas in the ``ci`` profile (scaled by the profile)
RUN_EXAMPLES, RESUME_EXAMPLES = 4, 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, default=2)
    replicas = parser.parse_args().replicas
    profiles.register()
    # TensorFlow's and Keras's objects live until the exit: frozen, they stay out of the
    # collection after every example (tests/properties/scenario.py), which then costs
    # milliseconds instead of ~0.3 s of CPU.
    gc.collect()
    gc.freeze()
    run = strategies.written_runs_first(replicas)(
        settings(max_examples=profiles.examples(RUN_EXAMPLES))(
            given(case=strategies.run_cases(replicas))(checks.check_run)))
    resume = settings(max_examples=profiles.examples(RESUME_EXAMPLES))(
        given(case=strategies.resume_cases(replicas))(checks.check_resume))
    run()
    resume()
    print(f"loop properties hold on {replicas} replicas "
          f"({settings.get_current_profile_name()} profile)")


if __name__ == "__main__":
    import traceback

    from trainer.runtime.fast_exit import exit_now

    try:
        main()
    except BaseException:  # noqa: BLE001 (printed; the exit status tells the test)
        traceback.print_exc()
        exit_now(1)
    exit_now(0)
