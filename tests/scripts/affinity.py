"""Prints this process's CPU affinity and arguments as JSON (a program to run under
launcher_scripts.jobs.numa_binding)."""

import json
import os
import sys

print(json.dumps({"cpus": sorted(os.sched_getaffinity(0)), "argv": sys.argv[1:]}), flush=True)
