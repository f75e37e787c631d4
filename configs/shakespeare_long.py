# configs/shakespeare.py at a 4096-token context: on a 12 GB card the FlashAttention backends
# (tiled, triton, triton_fwd, sdpa) fit and eager does not, so a comparison shows the memory
# FlashAttention saves, not only time.
#   python compare.py configs/shakespeare_long.py --max_memory_gb=12
#
# Sized by estimate (bf16 autocast, 8,192 tokens per micro-batch as in shakespeare.py;
# activation sizes measured on the CPU with autograd's saved-tensor hooks):
#   weights, gradients and AdamW moments, fp32: 31.5M parameters x 16 bytes   0.5 GiB
#   activations kept for backward, every backend: 0.33 GiB per 1,024 tokens  2.6 GiB
#     (mostly the 50,304-wide logits, bf16, and their fp32 log-softmax)
#   logit gradients at the start of backward, fp32 and bf16                  2.3 GiB
#   -> a FlashAttention backend: about 5.5 GiB, whatever block_size is
#   eager also keeps, per layer, the fp32 scores (for the logsumexp), the fp32 and the bf16
#   probabilities: 10 bytes x batch_size x n_head x block_size^2 x n_layer
#     = 11.3 GiB at block_size 4096 (batch_size 2), plus ~1.9 GiB of one layer's score
#     gradients in backward
#   -> eager: about 19 GiB. At block_size 2048 (batch_size 4) it would be about 12 GiB, too
#      close to the limit to show anything; hence 4096.
# Measured on an H200 capped at 12 GB (docs/benchmarks.md, the block-size sweep at this
# setting): eager ran out of memory; triton peaked at 6,069 MB and sdpa at 6,035 MB.
out_dir = "out-shakespeare-long"
eval_interval = 250
eval_iters = 200
log_interval = 10
always_save_checkpoint = False

n_layer = 6
n_head = 6
n_embd = 384
block_size = 4096
dropout = 0.2
bias = False

# 2 x 4096 = 8,192 tokens per micro-batch and 16,384 per optimizer step, as in shakespeare.py.
batch_size = 2
gradient_accumulation_steps = 2

learning_rate = 1e-3
max_iters = 2000
lr_decay_iters = 2000
min_lr = 1e-4
warmup_iters = 100
beta2 = 0.99
