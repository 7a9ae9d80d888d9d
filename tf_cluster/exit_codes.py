"""Exit statuses shared by the trainer and the launchers.

The retryable ones are in 128-255, the range schedulers treat as "killed, try again"
(the Kubeflow training operator's ``restartPolicy: ExitCode`` recreates a pod that exits
128-255 and fails the job on 1-127; the SLURM script this project emits requeues on
them; ``launch.multiworker --max_restarts`` restarts the group):

* :data:`EXIT_PREEMPTED` = 143 (128 + SIGTERM, what a process killed by SIGTERM
  reports): the task saved a checkpoint after SIGTERM; restarting resumes from it.
* :data:`EXIT_PEER_LOST` = 170: a peer task or host of the collective was lost (it
  died or became unreachable); this task stopped instead of hanging. Restarting resumes
  from the last checkpoint, once the cluster is whole again. 170 is no ``128 + N`` of a
  signal Linux sends, so it cannot be mistaken for one.
"""

EXIT_PREEMPTED = 143
EXIT_PEER_LOST = 170
RETRYABLE = (EXIT_PREEMPTED, EXIT_PEER_LOST)
