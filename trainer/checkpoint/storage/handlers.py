"""Orbax's handlers of a checkpoint step's two items, and orbax itself, loaded on first use.

A step directory holds two items: ``state`` (the arrays of :mod:`trainer.checkpoint.state`)
and ``manifest`` (JSON). Arrays are written by orbax's stock ``PyTreeCheckpointHandler``
(uncompressed: zstd saved little disk on a float training state for much more CPU per save;
benchmarks/README.md), so any orbax user can read them; with ``checkpoint.fast_io=True``
they are aligned ``.npy`` files written with O_DIRECT
(:mod:`trainer.checkpoint.storage.array_files`: much less CPU per async save on VMs whose
page cache is expensive; ``np.load`` reads them, plain orbax does not). Reading handles
both formats. Each item writes its :mod:`~trainer.checkpoint.storage.checksums` when orbax
finalises it.

Only the chief imports orbax (and JAX, kept on the CPU with ``JAX_PLATFORMS=cpu``), on
first use: a run without checkpoints starts as fast as plain Keras. Orbax takes its
process index from JAX, which is not initialised across TF workers, so each process's
orbax is single-process. Contexts: host only.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from trainer.checkpoint.storage import array_files, checksums, orbax_logs


def orbax():
    """Imports orbax (and JAX) on first use only; JAX stays off accelerators."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import orbax.checkpoint as ocp

    orbax_logs.quiet()
    return ocp


def state_handler(ocp, fast_io: bool, verified: bool = False, npy: Any = None):
    """The orbax handler of the ``state`` item.

    ``fast_io=False``: orbax's stock tensorstore handler (uncompressed). ``True``: the
    O_DIRECT ``.npy`` handler of :mod:`trainer.checkpoint.storage.array_files` (``npy``, or a new
    one), which also reads stock checkpoints; reading always uses it, so either format
    restores. ``verified``: the handler also writes the item's checksums (for saving;
    see :func:`_verified_handlers`).
    """
    cls = _verified_handlers(ocp)["state"] if verified else ocp.PyTreeCheckpointHandler
    if not fast_io:
        return cls(use_compression=False)
    import jax  # already imported by orbax; its handler keeps orbax's array metadata on

    npy = npy or array_files.npy_file_handler(ocp)
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, npy), (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)))
    return cls(use_ocdbt=False, use_compression=False, type_handler_registry=registry,
               **({"known_checksums": functools.partial(array_files.claim, npy)}
                  if verified else {}))


def saving_registry(ocp, fast_io: bool):
    """The item handlers of a manager: ``state`` and ``manifest``, both writing their
    checksums (registered by item, so orbax's global args registry is left alone)."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state = state_handler(ocp, fast_io, verified=True)
    manifest = _verified_handlers(ocp)["manifest"]()
    for args in (ocp.args.PyTreeSave, ocp.args.PyTreeRestore):
        registry.add("state", args, state)
    for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
        registry.add("manifest", args, manifest)
    return registry


@functools.cache
def _verified_handlers(ocp) -> dict[str, type]:
    """Orbax's PyTree and JSON handlers, each writing :mod:`~trainer.checkpoint.storage.checksums`
    of its item when orbax finalises it (inside the temporary step directory, before the
    commit; in orbax's background thread for an async save)."""

    class VerifiedPyTree(ocp.PyTreeCheckpointHandler):
        def __init__(self, *args, known_checksums=lambda path: None, **kwargs):
            super().__init__(*args, **kwargs)
            self._known = known_checksums

        def finalize(self, directory) -> None:
            super().finalize(directory)
            checksums.write(os.fspath(directory), self._known)

    class VerifiedJson(ocp.JsonCheckpointHandler):
        def finalize(self, directory) -> None:
            super().finalize(directory)
            checksums.write(os.fspath(directory))

    return {"state": VerifiedPyTree, "manifest": VerifiedJson}


def short_error(error: Exception) -> str:
    """The first, human-readable part of an orbax / tensorstore error."""
    text = str(error).split(" [tensorstore_spec")[0]
    return f"{type(error).__name__}: {text[:400]}"
