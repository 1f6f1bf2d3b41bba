"""A job program that refuses its inputs on every rank when it starts, as the launcher's job
programs do with a JobError (launcher_scripts.jobs.refusal): run under torchrun by
tests/test_job_refusals.py. Each rank names itself in its line."""

import sys

from launcher_scripts.jobs.process import process_info
from launcher_scripts.jobs.refusal import refuse

sys.exit(refuse(f"job.input: rank {process_info().rank} refuses it"))
