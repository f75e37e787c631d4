# The default GPU run: train.py's defaults (TrainConfig in training/config.py says why each).
# It sets nothing, so the two commands below are the same run; it names the run (wandb:
# <attn>-shakespeare) and is the base configs/shakespeare_long.py changes.
#   python train.py --attn=triton
#   python train.py configs/shakespeare.py --attn=triton
