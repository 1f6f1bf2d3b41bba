"""Export to a Triton model repository, the Triton model that serves it, and `serve`."""
