"""A distributed custom-training-loop framework for TensorFlow 2 and Keras 3.

Subclass :class:`trainer.Trainer`, name it in a config file, and run
``python -m trainer.main --config=CONFIG --workdir=DIR``. The same code runs on one
CPU, several GPUs, several machines and TPUs.

``import trainer`` is light: ``trainer.Trainer`` and ``trainer.Callback`` are loaded on
first use (PEP 562 module ``__getattr__``; ``from trainer import Trainer`` works the
same), so ``trainer.main`` and the config files (``from trainer import config``) check
flags and configs before TensorFlow is imported.
"""

import importlib as _importlib
import os as _os

# TensorFlow's C++ INFO lines (CPU feature notices) drown the run's own report; a value
# the user set wins.
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

__all__ = ["Callback", "Trainer"]
_LAZY = {"Callback": "trainer.callbacks", "Trainer": "trainer.trainer"}


def __getattr__(name: str):
    """Loads ``Trainer`` / ``Callback`` (and TensorFlow) on first access."""
    if name not in _LAZY:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    try:
        module = _importlib.import_module(_LAZY[name])
    except ImportError as error:
        if "tensorflow" not in str(error).lower():
            raise
        raise ImportError(
            "trainer needs TensorFlow, which is installed through an extra of this package: "
            "pip install 'tf-trainer[cpu]' (CPU), 'tf-trainer[gpu]' (NVIDIA GPUs, CUDA), "
            "'tf-trainer[tpu]' (Cloud TPU VMs) or 'tf-trainer[test]' (CPU + test tools). "
            f"Original error: {error}"
        ) from error
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted([*globals(), *__all__])
