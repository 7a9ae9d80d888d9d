"""scikit-learn's 8x8 digits as a real TFDS dataset, prepared offline into TFRecord files.

:class:`SklearnDigits` is a ``tfds.core.GeneratorBasedBuilder``: its examples come from
``sklearn.datasets.load_digits`` (shipped inside scikit-learn, no download), split into
``train``/``test`` by the builder config's ``split_seed``, and written as
:data:`NUM_SHARDS` TFRecord files per split (several files, so file-level sharding
over workers can be used and tested). :func:`prepare` builds it once into a TFDS data
directory (``""``: TFDS's default, ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``) and
afterwards only reads it: a second call rewrites nothing. Concurrent first calls (the
workers of one machine) serialise on a lock file (:func:`lock_path`: local also for a
``gs://`` data directory); the first prepares, the others reuse.

Features: ``image`` uint8 ``[64]`` (pixel intensities 0..16, as scikit-learn gives
them) and ``label`` (``ClassLabel``, 10 classes); supervised keys ``(image, label)``.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import tempfile

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from tf_cluster.storage_schemes import is_local

NUM_SHARDS = 4
TEST_FRACTION = 0.2


def split_indices(n: int, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, test)`` indices of ``n`` examples: a permutation by ``split_seed``."""
    order = np.random.default_rng(split_seed).permutation(n)
    n_test = int(round(n * TEST_FRACTION))
    return order[n_test:], order[:n_test]


@dataclasses.dataclass
class DigitsConfig(tfds.core.BuilderConfig):
    """A builder config per train/test split seed (name ``split_seed_<n>``)."""

    split_seed: int = 0


def digits_config(split_seed: int) -> DigitsConfig:
    """The builder config of ``split_seed``."""
    return DigitsConfig(name=f"split_seed_{split_seed}", split_seed=split_seed,
                        description=f"train/test split by seed {split_seed}")


class SklearnDigits(tfds.core.GeneratorBasedBuilder):
    """The 1,797 8x8 digits of scikit-learn, 80/20 split by seed; no download."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "First version: from sklearn.datasets.load_digits."}
    BUILDER_CONFIGS = [digits_config(0)]

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Tensor(shape=(64,), dtype=np.uint8),
                "label": tfds.features.ClassLabel(num_classes=10),
            }),
            supervised_keys=("image", "label"),
            homepage="https://scikit-learn.org/stable/datasets/toy_dataset.html",
        )

    def _split_generators(self, dl_manager):
        try:
            from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
        except ImportError as error:
            raise ImportError(
                "The digits dataset is built from scikit-learn: "
                "pip install 'tf-trainer[examples]'.") from error
        digits = load_digits()
        train, test = split_indices(len(digits.target), self.builder_config.split_seed)
        return {
            "train": self._generate_examples(digits, train),
            "test": self._generate_examples(digits, test),
        }

    def _generate_examples(self, digits, indices):
        for i in indices:
            yield int(i), {"image": digits.data[i].astype(np.uint8),
                           "label": int(digits.target[i])}


def prepare(data_dir: str = "", split_seed: int = 0) -> SklearnDigits:
    """Returns the builder of ``split_seed`` in ``data_dir``, preparing it the first time.

    Preparing writes :data:`NUM_SHARDS` TFRecord files per split (a second of work, no
    network); once prepared, nothing is written again. ``data_dir=""``: TFDS's default.
    """
    probe = builder_for(data_dir, split_seed)
    if not probe.is_prepared():
        root = os.fspath(probe.data_dir_root)
        epath.Path(root).mkdir(parents=True, exist_ok=True)  # local or gs://
        with open(lock_path(root), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                builder = builder_for(data_dir, split_seed)
                if not builder.is_prepared():
                    tfds.disable_progress_bar()
                    builder.download_and_prepare(
                        download_config=tfds.download.DownloadConfig(
                            num_shards=NUM_SHARDS, try_download_gcs=False))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    # A builder reads its dataset_info when it is made: ``probe`` may have been made just
    # before another process finished preparing (it then says prepared, with no splits).
    return builder_for(data_dir, split_seed)


def lock_path(root: str) -> str:
    """The lock file that serialises this machine's first :func:`prepare` calls of
    ``root``: in ``root`` when it is a local directory; for a bucket (``gs://...``,
    where ``flock`` cannot reach) a local file in the temp directory named by its hash."""
    if is_local(root):
        return os.path.join(root, ".sklearn_digits.lock")
    digest = hashlib.sha256(root.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"sklearn_digits-{digest}.lock")


def builder_for(data_dir: str, split_seed: int) -> SklearnDigits:
    """The builder of ``split_seed`` in ``data_dir`` (``""``: TFDS's default); no I/O."""
    registered = {c.split_seed: c.name for c in SklearnDigits.BUILDER_CONFIGS}
    config = registered.get(split_seed) or digits_config(split_seed)
    return SklearnDigits(config=config, data_dir=data_dir or None)
