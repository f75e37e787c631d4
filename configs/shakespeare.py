# The default GPU run: train.py's defaults, the fields of TrainConfig in
# training/config.py (whose comments say why each value). This file sets none of them, so
# the two commands below are the same run; it names the run (wandb: <attn>-shakespeare) and is
# the base that configs/shakespeare_long.py changes.
#   python train.py --attn=triton
#   python train.py configs/shakespeare.py --attn=triton
