"""Host and device memory and utilisation of this worker, sampled on demand."""

from __future__ import annotations

import statistics

import psutil
import tensorflow as tf

from trainer.distribution import strategies


class SystemSampler:
    """Host and device memory and utilisation, sampled once per logging window.

    Device memory uses ``tf.config.experimental.get_memory_info`` on this worker's
    non-CPU devices (max over devices; ``None`` on CPU-only runs, where the host RSS
    is the memory number). GPU utilisation needs NVML (``pip install nvidia-ml-py``);
    without it the value is ``None``, silently. CPU percentages are averages since
    the previous sample (``sys/process_cpu_percent`` can exceed 100 on several cores).
    """

    def __init__(self, strategy: tf.distribute.Strategy):
        self._process = psutil.Process()
        self._process.cpu_percent(None)
        psutil.cpu_percent(None)
        self._devices = strategies.accelerator_devices(strategy)
        self._nvml = self._init_nvml()

    @staticmethod
    def _init_nvml():
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                       for i in range(pynvml.nvmlDeviceGetCount())]
            return (pynvml, handles) if handles else None
        except Exception:  # noqa: BLE001 - NVML is optional: absent, no driver, no GPU
            return None

    def sample(self) -> dict[str, float | None]:
        rss = self._process.memory_info().rss
        out: dict[str, float | None] = {
            "mem/host_rss_mb": rss / 2**20,
            "mem/host_memory_fraction": rss / psutil.virtual_memory().total,
            "mem/device_current_mb": None, "mem/device_peak_mb": None,
            "mem/gpu_memory_fraction": None,
            "sys/host_cpu_percent": psutil.cpu_percent(None),
            "sys/process_cpu_percent": self._process.cpu_percent(None),
            "sys/gpu_util_percent": None,
        }
        infos = []
        for device in self._devices:
            try:
                infos.append(tf.config.experimental.get_memory_info(device))
            except (ValueError, RuntimeError):  # allocator stats not available here
                pass
        if infos:
            out["mem/device_current_mb"] = max(i["current"] for i in infos) / 2**20
            out["mem/device_peak_mb"] = max(i["peak"] for i in infos) / 2**20
        if self._nvml:
            pynvml, handles = self._nvml
            try:
                out["sys/gpu_util_percent"] = statistics.fmean(
                    pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles)
                out["mem/gpu_memory_fraction"] = max(
                    (m.used / m.total) for m in (pynvml.nvmlDeviceGetMemoryInfo(h)
                                                for h in handles))
            except Exception:  # noqa: BLE001 - a transient NVML error must not stop training
                pass
        return out

    def close(self) -> None:
        if self._nvml:
            try:
                self._nvml[0].nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
