"""What the scripts share:

    config.py     settings: the configurator (dataclass, config files, --key=value), the exit
                  statuses, TrainConfig and its checks; imports no torch, so it answers at once
    devices.py    device, precision, CPU threads, torchrun's processes, stop signals, the step's CUDA graph
    run_files.py  a run's out_dir: checkpoints, metrics, config.json, its lock
    profiling.py  where a training step's time goes

A regular package (not a namespace one), so no installed module named `training` can shadow it.
The scripts import training/; training/ imports model.py (profiling reads its ranges, run_files
checks checkpoints against GPTConfig); model.py and attention/ never import training/.
"""
