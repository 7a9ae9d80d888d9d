"""What the tests share: helpers, the toy Trainers, and the scripts tests start as
subprocesses (``python -m tests.support.run_*``; also config files for ``--config``).

* :mod:`tests.support.helpers` — subprocesses, comparing weights, free ports.
* :mod:`tests.support.toy` — the tiny deterministic Trainer most tests train.
* :mod:`tests.support.families` — the model families trained on 1, 2 and 4 replicas.
* :mod:`tests.support.telemetry_trainers` — Trainers shaped for telemetry and the doctor.
* ``run_*`` — training scripts and config files started by tests of several parts.
"""
