"""What the scripts share: config.py (settings, exit statuses; no torch), devices.py (device,
precision, threads, torchrun, signals, the step's CUDA graph), step.py (the training step
train.py takes and bench.py times), run_files.py (a run's out_dir) and profiling.py (where a
step's time goes). training/ imports model.py and data/; model.py, attention/ and data/ never
import training/. A regular package, so no installed `training` shadows it.
"""
