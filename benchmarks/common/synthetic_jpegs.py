"""An input-heavy TFDS dataset for benchmarks: JPEG-encoded 64x64x3 images, 10 labels.

A module of its own (not ``__main__``): TFDS locates a builder by its module's package.
"""

from __future__ import annotations

import numpy as np
import tensorflow_datasets as tfds

SIZE = 64
EXAMPLES = 6000
FILES = 8


class SyntheticJpegs(tfds.core.GeneratorBasedBuilder):
    """Random smooth images stored as JPEG (decoding them is real work)."""

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, examples: int = EXAMPLES, **kwargs):
        self.num_generated = examples
        super().__init__(**kwargs)

    def _info(self):
        return self.dataset_info_from_configs(features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(SIZE, SIZE, 3), encoding_format="jpeg"),
            "label": tfds.features.ClassLabel(num_classes=10)}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        rng = np.random.default_rng(0)
        for i in range(self.num_generated):
            small = rng.integers(0, 256, (8, 8, 3)).astype(np.float32)
            image = np.kron(small, np.ones((SIZE // 8, SIZE // 8, 1)))
            noise = rng.normal(0, 12, image.shape)
            yield i, {"image": np.clip(image + noise, 0, 255).astype(np.uint8),
                      "label": int(i % 10)}


def prepare(data_dir: str, examples: int = EXAMPLES, files: int = FILES) -> SyntheticJpegs:
    """The builder in ``data_dir/e<examples>_f<files>``, built there the first time."""
    builder = SyntheticJpegs(examples=examples, data_dir=f"{data_dir}/e{examples}_f{files}")
    if not builder.is_prepared():
        tfds.disable_progress_bar()
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
            num_shards=files, try_download_gcs=False))
    return builder
