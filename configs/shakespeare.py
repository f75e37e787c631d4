# The default GPU run: an 8-layer GPT on TinyShakespeare's GPT-2 tokens (11,706 of them,
# renumbered densely by prepare.py), sized to fit a 12 GB card with every attention backend,
# eager included. Its values are train.py's defaults, spelled out here.
#   python train.py configs/shakespeare.py --attn=triton
out_dir = "out-shakespeare"
# The whole run is a few hundred steps: evaluate often enough to see where val loss bottoms
# out. 50 batches of 4,096 tokens cover the 36k val tokens many times over.
eval_interval = 100
eval_iters = 50
log_interval = 10
# 19M parameters on 302k training tokens can overfit: keep the checkpoint with the best val
# loss rather than the latest.
always_save_checkpoint = False

n_layer = 8
n_head = 6
n_embd = 384  # head dim 64, within the Triton kernels' 16/32/64/128
# A 512-token context makes attention a large share of the step (its cost grows with the
# context, the matmuls' does not), which is what a comparison of attention backends needs,
# while eager's per-layer block_size^2 scores still fit a 12 GB card at this batch.
block_size = 512
# One pass over the training data is ~37 steps of 8k tokens, so the run sees each token many
# times: heavy dropout and weight decay hold off memorising it.
dropout = 0.35
bias = False
weight_decay = 0.5

# 4 x 512 tokens per micro-batch, two micro-batches: 4,096 tokens per optimizer step. On this
# small corpus more, smaller steps generalised better than fewer large ones (.ci/gpu recipe;
# docs/benchmarks.md has the candidates and their val losses).
batch_size = 4
gradient_accumulation_steps = 2

# The learning rate decays to zero where val loss stops improving, so it flattens rather than
# climbs at the end and the last checkpoint is near the best: a longer run only memorises.
learning_rate = 6e-4
max_iters = 2000
lr_decay_iters = 2000
min_lr = 0.0
warmup_iters = 100
beta2 = 0.99
