"""Programs the tests start in their own processes (they set up torch.distributed)."""
