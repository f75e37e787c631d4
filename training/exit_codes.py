"""The exit statuses of train.py, sample.py and compare.py, defined once. compare.py reads
train.py's to tell a run that ran out of memory from one that failed."""
EXIT_ERROR = 1  # an error stopped the script (bad data, an unusable checkpoint; compare.py: a run failed)
EXIT_BAD_CONFIG = 2  # bad configuration: the usual status for bad usage
EXIT_OUT_OF_MEMORY = 3  # the device ran out of memory


def exit_status_of_signal(signum):
    """128 + the signal's number, the shell's convention for "ended by a signal": 130 for
    SIGINT (Ctrl-C), 143 for SIGTERM."""
    return 128 + signum
