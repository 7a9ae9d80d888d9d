"""The model zoo: each model trains under one_device (in process) and on 2 Mirrored
replicas (one subprocess for all), TFDS models offline under ``tfds.testing.mock_data``;
the offline error path; the LM learns its embedded text; the GAN's two optimizers; sync
batch norm reproduces the one-replica run (and its negative control does not)."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, subprocess_env
from tests.support.run_models import MODELS, mock_tfds, tiny_config, train
from tests.support.helpers import max_abs_diff, saved_run

SYNC_BN_TOL = 1e-5


@pytest.fixture(scope="module")
def mirrored_runs(tmp_path_factory):
    """Every model on 2 virtual-device Mirrored replicas, started first, read on demand."""
    out = tmp_path_factory.mktemp("models2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.run_models", "replicas", "--replicas", "2",
         "--out", str(out)],
        cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cache = {}

    def result():
        if not cache:
            output, _ = proc.communicate(timeout=900)
            assert proc.returncode == 0, f"2-replica model runs failed:\n{output[-4000:]}"
            cache["results"] = json.loads((out / "results.json").read_text())
            cache["weights"] = dict(np.load(out / "weights.npz"))
        return cache

    yield result
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(autouse=True)
def start_mirrored_runs_early(mirrored_runs):
    """Depends on the module fixture so the subprocess runs alongside the in-process tests."""


@pytest.fixture
def no_network(monkeypatch):
    """Fails any Python-level network connection (what tfds downloads would open)."""
    attempts = []

    def refuse(self, address):
        attempts.append(address)
        raise OSError(f"test: network access to {address} is not allowed")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def changed(before: list, after: list) -> bool:
    return any(not np.array_equal(a, b) for a, b in zip(before, after))


def assert_finite(results: dict, keys: set) -> None:
    assert keys <= set(results), results
    assert all(math.isfinite(v) for v in results.values()), results


@pytest.fixture(scope="module")
def cifar10_one_replica():
    return train(tiny_config("cifar10"))


def test_mnist_trains_offline_on_mock_tfds_with_download_false(no_network):
    config = tiny_config("mnist")
    assert config.data.download is False
    with mock_tfds():
        from models import mnist

        t = mnist.MnistTrainer(config)
        before = t.model.get_weights()
        results = t.fit()
    assert t.step == config.train.steps
    assert_finite(results, {"train/loss", "train/accuracy", "eval/loss", "eval/accuracy"})
    assert changed(before, t.model.get_weights())
    assert no_network == []


def test_cifar10_resnet_trains_with_weight_decay_on_mock_tfds(cifar10_one_replica):
    t, results = cifar10_one_replica
    assert t.step == 4
    assert_finite(results, {"train/loss", "train/accuracy", "eval/loss", "eval/accuracy"})
    assert t.model.name == "resnet6"  # 2 + 2 convs x 1 block x 2 stages
    assert t.model.losses, "l2 > 0 must add regularisation losses"
    bn = [layer for layer in t.model.layers if layer.name.startswith("batch_normalization")]
    assert bn and all(layer.synchronized is False for layer in bn)


def test_tfds_model_without_prepared_data_fails_at_once_saying_how_to_prepare(tmp_path, no_network):
    from models import mnist, tfds_data

    config = tiny_config("mnist", **{"data.data_dir": str(tmp_path)})
    t = mnist.MnistTrainer(config)
    with pytest.raises(tfds_data.DataNotPreparedError) as error:
        t.fit()
    message = str(error.value)
    assert f"tfds build mnist --data_dir={tmp_path}" in message
    assert "--config.data.download=True" in message
    assert str(tmp_path) in message
    assert no_network == [], "download=False must not touch the network"


def test_lm_loss_decreases_on_its_embedded_text():
    from models import lm

    config = tiny_config("lm", **{"train.steps": 60, "train.steps_per_loop": 20,
                                  "train.log_every_steps": 20, "eval.steps": 4,
                                  "optimizer.learning_rate": 3e-3})
    assert config.data.text_file == "", "the default text must be the embedded one"
    t = lm.TransformerLMTrainer(config)
    before = t.evaluate()
    results = t.fit()
    assert before["loss"] > math.log(256) - 0.5  # untrained: close to uniform over bytes
    assert results["eval/loss"] < before["loss"] - 1.5, (before, results)
    assert results["eval/perplexity"] == pytest.approx(math.exp(results["eval/loss"]), rel=1e-4)


def test_lm_text_file_and_byte_tokenizer(tmp_path):
    from models import lm

    text = "héllo wörld\n" * 3
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    tokenizer = lm.ByteTokenizer()
    ids = tokenizer.encode(lm.load_text(str(path)))
    assert ids.dtype == np.int32 and len(ids) == len(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert len(lm.default_text()) > 100_000
    with pytest.raises(ValueError, match="too short for config.data.seq_len"):
        lm.TransformerLMTrainer(tiny_config("lm", **{"data.text_file": str(path)}))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        lm.load_text(str(tmp_path / "missing.txt"))


def test_gan_trains_both_networks_each_with_its_own_optimizer():
    from models import gan
    from models.digits import load_digits_split

    steps = 1500
    config = tiny_config("gan", **{"train.steps": steps, "train.steps_per_loop": 500,
                                   "train.log_every_steps": 500, "model.hidden": 128})
    t = gan.DigitsGANTrainer(config)
    g0, d0 = t.model.generator.get_weights(), t.model.discriminator.get_weights()
    (real, _), _ = load_digits_split()
    z = np.random.default_rng(0).normal(size=(512, config.model.latent_dim)).astype(np.float32)
    gap_before = np.abs(np.asarray(t.model(z)).mean(0) - real.mean(0)).mean()
    results = t.fit()
    assert_finite(results, {"train/loss", "train/d_loss", "train/g_loss", "train/d_real",
                            "train/d_fake"})
    assert changed(g0, t.model.generator.get_weights())
    assert changed(d0, t.model.discriminator.get_weights())
    assert int(t.optimizer.iterations.numpy()) == steps
    assert int(t.d_optimizer.iterations.numpy()) == steps
    # The generator's optimizer holds slots for the generator only (and vice versa).
    g_vars = {id(v) for v in t.model.generator.trainable_variables}
    assert len(t.optimizer.variables) == 2 + 2 * len(g_vars)  # iterations, lr, m and v
    # The generator learned something about the data: its mean image moved toward the
    # real one (0.28 -> ~0.12 mean absolute pixel gap after 1500 steps).
    gap_after = np.abs(np.asarray(t.model(z)).mean(0) - real.mean(0)).mean()
    assert gap_after < 0.7 * gap_before, (gap_before, gap_after)


@pytest.mark.parametrize("model", MODELS)
def test_model_trains_on_two_mirrored_replicas(mirrored_runs, model):
    run = mirrored_runs()["results"][model]
    assert run["strategy"] == "MirroredStrategy" and run["replicas"] == 2
    assert run["step"] == 4
    assert "train/loss" in run["fit"]
    assert all(math.isfinite(v) for v in run["fit"].values()), run


def test_sync_batch_norm_on_two_replicas_matches_one_replica(mirrored_runs, cifar10_one_replica):
    t, _ = cifar10_one_replica
    weights = mirrored_runs()["weights"]
    one = t.model.get_weights()

    def max_diff(run):
        return max_abs_diff(one, saved_run(weights, run))

    assert max_diff("cifar10_sync_bn") <= SYNC_BN_TOL
    # Negative control: per-replica batch statistics (sync_bn=False) give other weights.
    assert max_diff("cifar10") > 100 * SYNC_BN_TOL
