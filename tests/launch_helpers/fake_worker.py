"""A stand-in for ``trainer.main`` that lets launcher tests script a task's behaviour.

Reads ``TF_CONFIG`` and the JSON plan in ``FAKE_PLAN`` (``{"worker:1": {...}, "*": {...}}``,
the task's own entry wins over ``"*"``). Plan keys, applied in this order:

* ``silent``: write nothing at all and sleep forever;
* ``quiet``: write the ``started`` line, then nothing, and sleep forever;
* ``ignore_term``: ignore SIGTERM;
* ``bind``: bind this task's TF_CONFIG port (like TensorFlow's server); if it is taken,
  print gRPC's message and exit 1;
* ``crash_once``: a marker path; exit ``crash_code`` (default 3) the first time
  (creating the marker);
* ``code`` after ``seconds``: print a heartbeat every 0.2 s for ``seconds`` (default 0.5),
  then exit with ``code`` (default 0); ``seconds: -1`` runs forever.

First it prints ``started TASK PID ARGV`` and ``TF_CONFIG JSON`` so tests see the task,
its PID, its flags and its cluster view.
"""

import json
import os
import signal
import socket
import sys
import time


def main() -> int:
    tf_config = json.loads(os.environ["TF_CONFIG"])
    task = f"{tf_config['task']['type']}:{tf_config['task']['index']}"
    plans = json.loads(os.environ.get("FAKE_PLAN", "{}"))
    plan = plans.get(task, plans.get("*", {}))
    if plan.get("silent"):
        while True:
            time.sleep(60)
    print(f"started {task} {os.getpid()} {json.dumps(sys.argv[1:])}", flush=True)
    print(f"TF_CONFIG {json.dumps(tf_config)}", flush=True)
    while plan.get("quiet"):
        time.sleep(60)
    if plan.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = None
    if plan.get("bind"):
        address = tf_config["cluster"][tf_config["task"]["type"]][tf_config["task"]["index"]]
        host, port = address.rsplit(":", 1)
        sock = socket.socket()
        try:
            sock.bind((host, int(port)))
        except OSError:
            print(f"E0000 Address already in use; could not bind {address}", file=sys.stderr,
                  flush=True)
            return 1
    marker = plan.get("crash_once")
    if marker and not os.path.exists(marker):
        open(marker, "w").close()
        print(f"{task} crashing once", file=sys.stderr, flush=True)
        return plan.get("crash_code", 3)
    seconds = plan.get("seconds", 0.5)
    deadline = time.monotonic() + seconds
    while seconds < 0 or time.monotonic() < deadline:
        print(f"{task} tick", flush=True)
        time.sleep(0.2)
    print(f"{task} done", flush=True)
    return plan.get("code", 0)


if __name__ == "__main__":
    sys.exit(main())
