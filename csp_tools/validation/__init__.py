"""Cluster validation: node diagnostics and a pairwise interconnect sweep that names the nodes to
drain (the reference's csp_tools, section 4.2), one package for every CSP."""
