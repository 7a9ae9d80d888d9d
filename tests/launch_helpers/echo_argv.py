"""Prints its argv and CUDA_VISIBLE_DEVICES as one JSON line: a stand-in entry point."""

import json
import os
import sys

print("ECHO " + json.dumps({"argv": sys.argv[1:],
                            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}))
