"""Specification of TPU detection and the bounded connect (tf_cluster.tpu), and of
``python -m launch.tpu``.

No TPU is attached here: everything up to the hardware is tested, with
``TPUClusterResolver``, ``experimental_connect_to_cluster``, ``initialize_tpu_system``
and ``TPUStrategy`` mocked. What a real TPU answers is not tested (see docs/launch.md).
"""

import json
import os
import subprocess
import sys
import threading
from unittest import mock

import pytest

from tests.support.helpers import NO_TENSORFLOW_PRELUDE
from tf_cluster import tpu as tpu_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_TPU_ENV = {k: v for k, v in os.environ.items()
              if k not in ("COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE", "TF_CONFIG")}


@pytest.fixture
def no_dev(tmp_path):
    return str(tmp_path)


def run_tpu(args, env_extra=None, without_tensorflow=False):
    """``python -m launch.tpu ARGS``; ``without_tensorflow``: with an import of TensorFlow
    made to fail loudly (``NO_TENSORFLOW_PRELUDE``)."""
    env = dict(NO_TPU_ENV, PYTHONPATH=REPO, **(env_extra or {}))
    start = ["-c", NO_TENSORFLOW_PRELUDE] if without_tensorflow else ["-m"]
    return subprocess.run([sys.executable, *start, "launch.tpu", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def echoed(result):
    line = next(l for l in result.stdout.splitlines() if l.startswith("ECHO "))
    return json.loads(line[5:])


@pytest.mark.parametrize("var", ["COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE"])
def test_tpu_attached_sees_the_environment(var, no_dev):
    assert tpu_lib.tpu_attached({var: "x"}, dev_dir=no_dev)


def test_tpu_attached_is_false_without_env_or_devices(no_dev, tmp_path):
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "vfio").touch()  # the vfio control node alone is not a TPU
    assert not tpu_lib.tpu_attached({}, dev_dir=no_dev)


@pytest.mark.parametrize("device", ["accel0", "vfio/0"])
def test_tpu_attached_sees_local_tpu_devices(device, tmp_path):
    (tmp_path / "vfio").mkdir()
    (tmp_path / device).touch()
    assert tpu_lib.tpu_attached({}, dev_dir=str(tmp_path))
    assert tpu_lib.resolve_tpu("", {}, dev_dir=str(tmp_path)) == "local"


def test_resolve_prefers_colab_address_then_tpu_name(no_dev):
    env = {"COLAB_TPU_ADDR": "10.0.0.2:8470", "TPU_NAME": "my-tpu"}
    assert tpu_lib.resolve_tpu("", env, no_dev) == "grpc://10.0.0.2:8470"
    assert tpu_lib.resolve_tpu("", {"TPU_NAME": "my-tpu"}, no_dev) == "my-tpu"
    assert tpu_lib.resolve_tpu("", {"TPU_ACCELERATOR_TYPE": "v5litepod-8"}, no_dev) == "local"


def test_resolve_passes_an_explicit_name_or_address_through(no_dev):
    env = {"COLAB_TPU_ADDR": "10.0.0.2:8470"}
    assert tpu_lib.resolve_tpu("other-tpu", env, no_dev) == "other-tpu"
    assert tpu_lib.resolve_tpu("grpc://10.0.0.9:8470", env, no_dev) == "grpc://10.0.0.9:8470"


def test_resolve_without_tpu_says_what_to_do(no_dev):
    with pytest.raises(tpu_lib.TPUNotFoundError,
                       match=r"no TPU found: .*use --config.distribute.strategy=auto or mirrored"):
        tpu_lib.resolve_tpu("", {}, no_dev)


def test_resolve_local_without_a_device_fails(no_dev):
    with pytest.raises(tpu_lib.TPUNotFoundError, match="tpu='local' but this host has no TPU"):
        tpu_lib.resolve_tpu("local", {}, no_dev)


@pytest.mark.parametrize("address", ["grpc://10.0.0.1", "http://10.0.0.1:8470"])
def test_resolve_rejects_malformed_addresses(address, no_dev):
    with pytest.raises(ValueError):
        tpu_lib.resolve_tpu(address, {}, no_dev)


def test_connect_without_tpu_fails_fast_without_importing_tensorflow():
    """Fast means: it fails on the detection alone, before TensorFlow is imported (the
    import is the slow part; the time it takes is not asserted here)."""
    code = ("import sys; from tf_cluster import tpu\n"
            "try:\n    tpu.connect_tpu('')\n"
            "except tpu.TPUNotFoundError as e:\n"
            "    print('ERR', 'tensorflow' in sys.modules, e)\n")
    result = subprocess.run([sys.executable, "-c", code], env=dict(NO_TPU_ENV, PYTHONPATH=REPO),
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    _, tf_loaded, message = result.stdout.split(" ", 2)
    assert tf_loaded == "False"
    assert "no TPU found" in message


@pytest.fixture
def tf_mocks():
    import tensorflow as tf

    resolver = mock.MagicMock(name="resolver")
    calls = []
    with mock.patch.object(tf.distribute.cluster_resolver, "TPUClusterResolver",
                           side_effect=lambda tpu: calls.append(("resolver", tpu)) or resolver), \
         mock.patch.object(tf.config, "experimental_connect_to_cluster",
                           side_effect=lambda r: calls.append(("connect", r))), \
         mock.patch.object(tf.tpu.experimental, "initialize_tpu_system",
                           side_effect=lambda r: calls.append(("initialize", r))) as init:
        yield resolver, calls, init


def test_connect_resolves_connects_and_initialises_in_order(tf_mocks):
    resolver, calls, _ = tf_mocks
    assert tpu_lib.connect_tpu("grpc://10.1.2.3:8470", timeout_s=10) is resolver
    assert calls == [("resolver", "grpc://10.1.2.3:8470"), ("connect", resolver),
                     ("initialize", resolver)]


def test_connect_that_hangs_raises_at_its_timeout_naming_address_and_step(tf_mocks):
    """The error comes while the initialisation still hangs: connect_tpu gave up at its
    timeout instead of waiting for the hung call (which returns only when released)."""
    _, _, init = tf_mocks
    release, returned = threading.Event(), threading.Event()
    init.side_effect = lambda r: (release.wait(300), returned.set())
    try:
        with pytest.raises(tpu_lib.TPUConnectError,
                           match=r"TPU 'grpc://10.9.9.9:8470' did not answer within 0.5 s "
                                 r"\(still initialising"):
            tpu_lib.connect_tpu("grpc://10.9.9.9:8470", timeout_s=0.5)
        assert init.called and not returned.is_set()
    finally:
        release.set()


def test_connect_failure_is_reported_with_the_step(tf_mocks):
    _, _, init = tf_mocks
    init.side_effect = RuntimeError("TPU system is busy")
    with pytest.raises(tpu_lib.TPUConnectError,
                       match=r"could not use TPU 'my-tpu' while initialising.*TPU system is busy"):
        tpu_lib.connect_tpu("my-tpu", timeout_s=10)


def test_trainer_builds_tpu_strategy_from_the_connected_resolver(tf_mocks):
    import tensorflow as tf

    from trainer import config as config_lib
    from trainer.distribution import strategies

    resolver, calls, _ = tf_mocks
    dcfg = config_lib.get_config().distribute
    dcfg.strategy, dcfg.tpu = "tpu", "grpc://10.1.2.3:8470"
    with mock.patch.object(tf.distribute, "TPUStrategy") as strategy_cls:
        strategy = strategies.build_strategy(dcfg)
    strategy_cls.assert_called_once_with(resolver)
    assert strategy is strategy_cls.return_value
    assert calls[0] == ("resolver", "grpc://10.1.2.3:8470")


def test_cli_without_tpu_fails_fast_with_advice():
    """Fast means: without importing TensorFlow (the time is not asserted)."""
    result = run_tpu(["--config=models/configs/digits.py", "--workdir=/tmp/x"],
                     without_tensorflow=True)
    assert result.returncode == 1, result.stderr
    assert "TENSORFLOW IMPORTED" not in result.stderr, result.stderr
    assert "no TPU found" in result.stderr
    assert "--config.distribute.strategy=auto or mirrored" in result.stderr


def test_cli_runs_the_trainer_on_the_tpu_with_bfloat16_by_default():
    result = run_tpu(["--module", "tests.launch_helpers.echo_argv", "--config=c.py"],
                        {"COLAB_TPU_ADDR": "10.0.0.2:8470"})
    assert result.returncode == 0, result.stderr
    assert echoed(result)["argv"] == [
        "--config=c.py", "--config.distribute.strategy=tpu",
        "--config.distribute.tpu=grpc://10.0.0.2:8470", "--config.precision.policy=mixed_bfloat16"]
    assert "TPU 'grpc://10.0.0.2:8470'" in result.stderr


def test_cli_keeps_the_users_precision_policy():
    result = run_tpu(["--tpu", "my-tpu", "--module", "tests.launch_helpers.echo_argv",
                         "--config.precision.policy=float32"])
    assert result.returncode == 0, result.stderr
    assert echoed(result)["argv"] == ["--config.precision.policy=float32",
                                      "--config.distribute.strategy=tpu",
                                      "--config.distribute.tpu=my-tpu"]


def test_cli_refuses_a_strategy_flag():
    result = run_tpu(["--tpu", "my-tpu", "--config.distribute.strategy=mirrored"])
    assert result.returncode == 2
    assert "set by this launcher; use --tpu instead" in result.stderr
