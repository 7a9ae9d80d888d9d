"""Launchers: start the trainer as one process, a local worker group, one host's tasks of
a cluster, or print what a scheduler needs.

Commands:

* :mod:`launch.multiworker`: the command line of the multi-worker launchers (parses and
  dispatches to the three below);
* :mod:`launch.mirrored`: one process with ``MirroredStrategy``;
* :mod:`launch.tpu`: find the TPU, then run the trainer on it;
* :mod:`launch.tf_config`: check this process's TF_CONFIG, or derive it inside SLURM;
* :mod:`launch.data_service`: a standalone tf.data service (:mod:`launch.data_service_server`
  is one of its processes).

Engines:

* :mod:`launch.local_group`: every task on this machine over loopback;
* :mod:`launch.hosts`: the per-host launcher (this host's tasks of a cluster of named
  hosts) and per-task TF_CONFIGs for hosts started some other way;
* :mod:`launch.slurm`: the sbatch script and what its tasks run inside the job;
* :mod:`launch.tfjob`: a Kubeflow TFJob manifest.

Shared: :mod:`launch.group` (preflight check, task specs, restarts),
:mod:`launch.supervision` (a process group that lives and dies together),
:mod:`launch.cluster` (host lists and their safety, task commands), :mod:`launch.flags`
(reading the trainer flags as absl does). What the trainer shares with the launchers
(TF_CONFIG's format, ports, TPU, exit statuses) is :mod:`tf_cluster`, below both.

Nothing in this package imports TensorFlow at import time: the launchers start the
processes that do, and ``TF_CONFIG`` / ``CUDA_VISIBLE_DEVICES`` must be set before
TensorFlow loads.
"""
