"""notebooks/colab_tpu.ipynb runs top to bottom on CPU (nbclient), with tiny step counts.

The test injects a cell after the ``parameters`` cell (as papermill does) and trains
MNIST with ``download=False`` from a prepared data directory of random images
(:func:`tests.support.run_models.write_fake_tfds`): no network. The Colab-only and TPU-only
cells are guarded by ``ON_COLAB`` / ``TPU_PRESENT`` and must say what they skipped.
"""

from __future__ import annotations

import json
import math

import nbformat
from nbclient import NotebookClient

from tests.conftest import REPO
from tests.support.run_models import write_fake_tfds

NOTEBOOK = REPO / "notebooks" / "colab_tpu.ipynb"
TPU_ENV = ("COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE", "COLAB_RELEASE_TAG")


def outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts.append("".join(output.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def parameters_index(nb) -> int:
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "the notebook needs exactly one cell tagged 'parameters'"
    return tagged[0]


def test_notebook_pins_an_existing_tensorflow_tpu_pair_and_guards_installs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert 'pip_install("tensorflow==2.20.*")' in source
    assert '"tensorflow-tpu==2.20.0"' in source
    assert "if ON_COLAB and TPU_PRESENT:" in source
    assert 'pip_install(f"git+{REPO_URL}@{GIT_REF}")' in source
    assert "connect_tpu(" in source and "tpu_attached()" in source
    assert 'PRECISION = "mixed_bfloat16"' in source


def test_notebook_runs_on_cpu_with_the_fallback_message(tmp_path, monkeypatch):
    for name in TPU_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    workdir = tmp_path / "run"
    data_dir = write_fake_tfds(str(tmp_path / "tfds"))
    injected = nbformat.v4.new_code_cell(
        f"TRAIN_STEPS = 4\nSTEPS_PER_LOOP = 2\nGLOBAL_BATCH_SIZE = 16\nEVAL_STEPS = 2\n"
        f"WORKDIR = {str(workdir)!r}\nDATA_DIR = {data_dir!r}\nDOWNLOAD = False\n")
    nb.cells.insert(parameters_index(nb) + 1, injected)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(REPO)}}).execute()

    text = outputs_text(nb)
    assert "Not on Colab: installing nothing" in text
    assert "TPU packages: not installed (on Colab: False, TPU attached: False)" in text
    assert "No TPU attached: falling back to the CPU" in text
    assert "TensorBoard inline is shown on Colab" in text
    final = [line for line in text.splitlines() if line.startswith("FINAL ")]
    assert len(final) == 1, text[-3000:]
    results = json.loads(final[0][len("FINAL "):])
    assert {"train/loss", "train/accuracy", "eval/loss", "eval/accuracy"} <= set(results)
    assert all(math.isfinite(v) for v in results.values())


def test_notebook_parameters_cell_defaults_train_mnist_on_tpu_sizes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    namespace: dict = {}
    exec(nb.cells[parameters_index(nb)].source, namespace)  # plain assignments only
    assert namespace["DATASET"] == "mnist"
    assert namespace["GLOBAL_BATCH_SIZE"] % 8 == 0  # 8 TPU cores on a v2-8 / v3-8
    assert "YOUR_ORG" in namespace["REPO_URL"]  # the placeholder the user edits
    assert namespace["WORKDIR"] == "gs://YOUR_BUCKET/runs/mnist"  # checkpoints in a bucket
