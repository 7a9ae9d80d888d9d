"""Where a path lives: the two questions asked of every path (:func:`is_bucket`,
:func:`is_local`), which URLs TensorFlow 2.21 can write, the one line for those it cannot,
and local paths made absolute where they are read.

Shared by ``trainer.cli`` (``--workdir``, checked before TensorFlow is imported) and the
launchers (``launch.tfjob``: a manifest whose trainers would all fail at once), so both
give the same advice. Pure Python, no TensorFlow.
"""

from __future__ import annotations

import os

#: URL schemes TensorFlow 2.21's own file systems reach (``tf.io.gfile``, checkpoints,
#: TensorBoard); a local path has none. Others raise "File system scheme not implemented"
#: at the first write, after TensorFlow's import.
TENSORFLOW_SCHEMES = ("gs", "ram")
BUCKET_SCHEME = "gs://"


def is_bucket(path: str | None) -> bool:
    """Whether ``path`` is in a Google Cloud Storage bucket (``gs://``, any case): reached
    through google-cloud-storage, where checkpoint steps are staged and uploaded, the
    lease is a bucket object and appended files are composed."""
    return bool(path) and path.lower().startswith(BUCKET_SCHEME)


def is_local(path: str | None) -> bool:
    """Whether ``path`` is a path of this machine's file system (no ``scheme://``: not
    ``gs://``, nor ``ram://`` nor any other URL), which ``os`` functions reach, made
    absolute where it is read (:func:`absolute`)."""
    return bool(path) and "://" not in path


def unreachable_scheme(path: str, what: str) -> str | None:
    """None when TensorFlow's file systems reach ``path`` (a local path, ``gs://``);
    otherwise the one line saying so and what to use instead, starting ``what=path``
    (``s3://``: a mounted bucket, see docs/checkpoints.md)."""
    scheme = path.split("://", 1)[0].lower()
    if is_local(path) or scheme in TENSORFLOW_SCHEMES:
        return None
    if scheme in ("s3", "s3a", "s3n"):
        return (f"{what}={path}: TensorFlow 2.21 has no S3 file system (it moved to "
                f"tensorflow-io, whose newest release, 0.37.1, does not load on it), so checkpoints, "
                f"TensorBoard events and exports cannot be written there. Mount the bucket "
                f"(s3fs) and give the mount point, e.g. "
                f"{what}=/mnt/{path.split('://', 1)[1]}; or use a gs:// bucket.")
    return (f"{what}={path}: TensorFlow 2.21 has no file system for '{scheme}://' (it "
            f"reaches local paths and gs://). Mount the storage and give the mount point, "
            f"or use a gs:// bucket.")


def absolute(path: str) -> str:
    """``path`` made absolute against this process's working directory (``~`` expanded);
    a URL (``gs://...``) unchanged. Orbax refuses relative checkpoint paths, and a task
    started elsewhere (a Slurm node, another host, a notebook after ``os.chdir``) would
    read a relative one against another directory: every path a user passes is resolved
    where it is read."""
    if not is_local(path):
        return path
    return os.path.abspath(os.path.expanduser(path))
