"""Specification of :mod:`launch.gpus`: the GPUs a launcher finds without TensorFlow."""

import sys

from launch.gpus import FoundGpus, found_gpus, gpu_device_files, missing_gpus, nvidia_smi_gpus


def fake_dev(tmp_path, *names):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in names:
        (dev / name).write_text("")
    return str(dev)


def fake_nvidia_smi(tmp_path, listing, status=0):
    program = tmp_path / "nvidia-smi"
    program.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write({listing!r})\n"
                       f"sys.exit({status})\n")
    program.chmod(0o755)
    return str(program)


def test_device_files_give_the_gpu_numbers_in_numeric_order(tmp_path):
    dev = fake_dev(tmp_path, "nvidia10", "nvidia2", "nvidiactl", "nvidia-uvm", "nvidia0")
    assert gpu_device_files(dev) == ["0", "2", "10"]
    assert found_gpus({}, dev=dev, nvidia_smi="/nonexistent") == FoundGpus(
        ("0", "2", "10"), f"{dev}/nvidia*")


def test_cuda_visible_devices_wins_over_the_device_files(tmp_path):
    dev = fake_dev(tmp_path, "nvidia0", "nvidia1", "nvidia2")
    assert found_gpus({"CUDA_VISIBLE_DEVICES": "2, 1"}, dev=dev).ids == ("2", "1")
    hidden = found_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, dev=dev)
    assert hidden.ids == () and hidden.describe() == "none (CUDA_VISIBLE_DEVICES='-1')"
    assert found_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,1"}, dev=dev).ids == ("0",)


def test_nvidia_smi_lists_gpus_when_there_are_no_device_files(tmp_path):
    smi = fake_nvidia_smi(tmp_path, "GPU 0: A100 (UUID: GPU-1)\nGPU 1: A100 (UUID: GPU-2)\n")
    found = found_gpus({}, dev=fake_dev(tmp_path), nvidia_smi=smi)
    assert found == FoundGpus(("0", "1"), "nvidia-smi -L")
    assert found.describe() == "0, 1 (nvidia-smi -L)"


def test_no_gpu_says_where_it_looked(tmp_path):
    dev = fake_dev(tmp_path)
    failing = fake_nvidia_smi(tmp_path, "", status=9)
    assert nvidia_smi_gpus(failing) is None
    assert found_gpus({}, dev=dev, nvidia_smi=failing).describe() == (
        f"none (no CUDA_VISIBLE_DEVICES, no {dev}/nvidiaN device, no nvidia-smi)")
    empty = fake_nvidia_smi(tmp_path, "No devices found.\n")
    assert found_gpus({}, dev=dev, nvidia_smi=empty).source.endswith("nvidia-smi lists none")


def test_missing_gpus_are_the_wanted_ids_not_found():
    assert missing_gpus([0, 3, 1], FoundGpus(("0", "1"), "x")) == [3]
    assert missing_gpus([0], FoundGpus((), "x")) == [0]
