"""Benchmarks: the service next to its peers on the same machine, in one run (`python -m bench`)."""
