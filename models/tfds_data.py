"""Loading TensorFlow Datasets (TFDS) splits offline-first, with a fast, explicit failure.

``tfds.load`` with its default ``download=True`` retries downloads for minutes on a
machine without internet. Here the download happens only when the config asks for it
(``config.data.download=True``); otherwise a split that is not prepared in
``config.data.data_dir`` raises :class:`DataNotPreparedError` at once, saying how to
prepare it, and a data directory that cannot be written when a download needs it
raises :class:`DataDirError`; both are user errors (:class:`trainer.errors.UserError`:
one message, no traceback). ``tensorflow_datasets`` is imported inside :func:`load_split` (it costs
~0.3 s and is not needed by the other models).

Data settings read from ``config.data`` (free-form section):

* ``data_dir``: TFDS data directory; ``""`` means TFDS's default (``$TFDS_DATA_DIR`` or
  ``~/tensorflow_datasets``);
* ``download``: False (default) never touches the network.
"""

from __future__ import annotations

import errno
import os

import ml_collections
import tensorflow as tf

import trainer.data
from trainer.errors import UserError

# errno of a directory that cannot take the files (read-only, permissions, a file in the path).
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.ENOSPC,
               errno.EDQUOT)


class DataNotPreparedError(UserError, FileNotFoundError):
    """A TFDS dataset is not prepared in the data directory and downloading is off."""

    prefix = "Data error"


class DataDirError(UserError, OSError):
    """The TFDS data directory cannot be written while a download needs it."""

    prefix = "Data error"


def default_data_dir() -> str:
    """The directory TFDS uses when ``config.data.data_dir`` is empty."""
    return os.environ.get("TFDS_DATA_DIR") or os.path.expanduser("~/tensorflow_datasets")


def not_prepared_message(name: str, data_dir: str) -> str:
    """How to prepare ``name`` for ``data_dir`` (``""``: the TFDS default directory)."""
    where = data_dir or (f"{default_data_dir()} (TFDS's default: $TFDS_DATA_DIR or "
                         f"~/tensorflow_datasets)")
    target = data_dir or "DIR"
    return (
        f"TFDS dataset '{name}' is not prepared in {where} and config.data.download is "
        f"False, so nothing was downloaded. Either prepare it once on a machine with "
        f"internet: `tfds build {name} --data_dir={target}` (copy {target} to this "
        f"machine if it has no internet) and run with --config.data.data_dir={target}; "
        f"or let this run download it: --config.data.download=True. For a run with no "
        f"data at all, use models/configs/digits.py (embedded in scikit-learn).")


def load_split(name: str, split: str, data_config: ml_collections.ConfigDict) -> tf.data.Dataset:
    """Returns ``tfds.load(name, split=split, as_supervised=True)``: ``(image, label)``.

    Reads ``data_config.data_dir`` and ``data_config.download`` (see the module
    docstring). Works under ``tfds.testing.mock_data`` (which replaces the stored data).

    Raises:
      DataNotPreparedError: the split is not in ``data_dir`` and ``download`` is False.
      DataDirError: the download cannot write to ``data_dir`` (read-only, permissions,
        a file in the path, full disk).
    """
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

    data_dir = data_config.data_dir or None
    download = bool(data_config.download)
    try:
        return tfds.load(name, split=split, data_dir=data_dir, download=download,
                         as_supervised=True, shuffle_files=False)
    except AssertionError as error:
        # tfds signals "not prepared" with an AssertionError ("could not find data").
        if download or "could not find data" not in str(error):
            raise
        raise DataNotPreparedError(not_prepared_message(name, data_dir or "")) from error
    except OSError as error:
        if error.errno not in _UNWRITABLE:
            raise
        where = data_dir or default_data_dir()
        raise DataDirError(
            f"TFDS cannot write the data directory {where} to download '{name}': "
            f"{os.strerror(error.errno)} ({error.filename or where}). Set "
            f"--config.data.data_dir=DIR (or $TFDS_DATA_DIR) to a directory this user can "
            f"write, or prepare the data elsewhere: `tfds build {name} --data_dir=DIR`."
        ) from error


def read_split(builder, split: str, ctx: tf.distribute.InputContext | None = None, *,
               sharding: str = "auto", add_tfds_id: bool = False) -> tf.data.Dataset:
    """``builder.as_dataset(split)`` (dicts of features), file-sharded when it can be.

    Host side, inside ``build_*_dataset(ctx)``. With ``ctx`` of several input pipelines
    and at least as many files in ``split`` as pipelines (``sharding`` "auto" or
    "file", see :func:`trainer.data.file_shard_context`), each pipeline reads only its
    own files (TFDS ``ReadConfig(input_context=ctx)``); otherwise every pipeline reads
    all files and the framework shards by batch. Files are read in a fixed order
    (no file shuffling), so the stream is deterministic: shuffle after this call.
    ``add_tfds_id``: each example also carries TFDS's ``tfds_id`` (its file and index).
    """
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

    num_files = builder.info.splits[split].num_shards
    context = (trainer.data.file_shard_context(ctx, num_files, f"{builder.name}/{split}",
                                               sharding) if ctx is not None else None)
    # No cardinality assertion: under the tf.data service ("distributed_epoch") a service
    # worker reads only the splits the dispatcher hands it, fewer than the split's size.
    read_config = tfds.ReadConfig(input_context=context, add_tfds_id=add_tfds_id,
                                  try_autocache=False, assert_cardinality=False)
    return builder.as_dataset(split=split, shuffle_files=False, read_config=read_config)
