"""What the trainer and the launchers share about a cluster, below both of them.

* :mod:`tf_cluster.tf_config`: ``TF_CONFIG``'s format (build, validate, addresses, task
  names).
* :mod:`tf_cluster.ports`: whether a task's port is free here, who holds it, whether a
  peer answers.
* :mod:`tf_cluster.tpu`: finding and connecting a TPU (TensorFlow only inside
  :func:`tf_cluster.tpu.connect_tpu`).
* :mod:`tf_cluster.exit_codes`: the exit statuses a task reports and launchers and
  schedulers act on (preempted 143, peer lost 170).
* :mod:`tf_cluster.storage_schemes`: which workdir URLs TensorFlow writes (local, gs://)
  and the one line for those it cannot (s3://: mount it).
* :mod:`tf_cluster.batch_script`: bash the emitted sbatch scripts share (waiting for
  their background work while a trap may interrupt).

Pure Python: it imports neither ``trainer`` nor ``launch`` (both import it), nor
TensorFlow at import time.
"""
