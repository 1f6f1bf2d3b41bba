"""The inference search (run_inference_hp_search): TP x PP x batch size for serving a portable
model, measured on this machine. search.py runs it from settings.py's checked settings, with
prompts.py's prompts, through runs.py (the runner path, bench.py in TP x PP processes) and
triton.py (a real Triton server); report.py writes the summary."""
