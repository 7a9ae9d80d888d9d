"""Hypothesis profiles of the property tests (see tests/README.md).

* ``ci``: derandomized (the same examples on every run, no example database), few
  examples, no shrinking (a failure prints the example as drawn; replay it under
  ``dev`` to shrink it): the whole property suite stays within a few minutes. Loaded
  when the environment has ``CI=true``.
* ``dev`` (default): random examples, a few more, remembered in ``.hypothesis/``.
* ``thorough``: many random examples, for a local hunt (tens of minutes).

Every profile has no deadline (the first example of a process traces TensorFlow) and
lets slow data generation through (an example is a whole training run).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

#: examples per property in each profile; a property scales them by its own weight.
EXAMPLES = {"ci": 1.0, "dev": 1.5, "thorough": 10.0}
PROFILE_ENV = "TF_TRAINER_HYPOTHESIS_PROFILE"  # passed on to the replica subprocess


def register() -> None:
    """Registers the profiles and loads ``ci`` under CI=true, else the one named in
    ``$TF_TRAINER_HYPOTHESIS_PROFILE``, else ``dev`` (``--hypothesis-profile`` wins)."""
    common = dict(deadline=None, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.register_profile("ci", derandomize=True, database=None,
                              phases=(Phase.explicit, Phase.generate), **common)
    settings.register_profile("dev", **common)
    settings.register_profile("thorough", **common)
    if os.environ.get("CI", "").lower() == "true":
        settings.load_profile("ci")
    else:
        settings.load_profile(os.environ.get(PROFILE_ENV, "dev"))


def examples(base: int) -> int:
    """``base`` examples scaled for the current profile."""
    return max(1, round(base * EXAMPLES.get(settings.get_current_profile_name(), 1.0)))
