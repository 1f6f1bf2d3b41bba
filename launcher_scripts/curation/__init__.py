"""Data curation's torch-free side: the document record, the registered steps and sources a
data_curation recipe names, their settings and checks, and the MinHash and n-gram arithmetic
the jobs share. Heavy libraries (datatrove, fastText, ftfy) are imported only when a job
builds a step, so preflight reads this package cheaply.
"""
