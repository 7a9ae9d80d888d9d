"""A distributed custom-training-loop framework for TensorFlow 2 and Keras 3.

Subclass :class:`trainer.Trainer`, name it in a config file, and run
``python -m trainer.main --config=CONFIG --workdir=DIR``. The same code runs on one
CPU, several GPUs, several machines and TPUs.
"""

import os as _os

# TensorFlow's C++ INFO lines (CPU feature notices) drown the run's own report; a value
# the user set wins.
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

try:
    import tensorflow as _tf  # noqa: F401
except ImportError as _error:  # pragma: no cover - exercised in a TF-less venv only
    raise ImportError(
        "trainer needs TensorFlow, which is installed through an extra of this package: "
        "pip install 'tf-trainer[cpu]' (CPU), 'tf-trainer[gpu]' (NVIDIA GPUs, CUDA), "
        "'tf-trainer[tpu]' (Cloud TPU VMs) or 'tf-trainer[test]' (CPU + test tools). "
        f"Original error: {_error}"
    ) from _error

from trainer.callbacks import Callback  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402

__all__ = ["Callback", "Trainer"]
