"""What the scripts share to run training: settings (configurator, train_config), checkpoints,
devices, a run's files (metrics, atomic), data-parallel processes (ddp), profiling and the exit
statuses (exit_codes).

A regular package (not a namespace one), so no installed module named `training` can shadow it.
Layout: the scripts import training/, training/ imports model.py (profiling reads its ranges);
model.py and attention/ never import training/.
"""
