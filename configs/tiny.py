# A model small enough to train on 2 CPU cores: 100 iterations in well under a minute with
# the eager backend on a quiet machine (the README's "On a CPU" paragraph has the measurement).
# Used by the tests and CI; head dim 32, within the Triton kernels' limits.
#   python train.py configs/tiny.py
out_dir = "out-tiny"
device = "cpu"
n_layer = 2
n_head = 2
n_embd = 64
block_size = 64
batch_size = 8
gradient_accumulation_steps = 1
dropout = 0.0
learning_rate = 2e-3
max_iters = 100
lr_decay_iters = 100
min_lr = 2e-4
warmup_iters = 10
eval_interval = 50
eval_iters = 10
log_interval = 10
always_save_checkpoint = True
