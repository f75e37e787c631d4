"""Datasets: data/<name>/prepare.py writes token files, data/batches.py reads them. A regular
package, so that no installed module named `data` can shadow it."""
