"""Datasets: data/<name>/prepare.py writes token files, data/batches.py reads them.

A regular package (not a namespace one), so no installed module named `data` can shadow it.
"""
