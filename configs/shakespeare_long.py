# The default run (configs/shakespeare.py) at a 4096-token context: on a 12 GB card the
# FlashAttention backends (tiled, triton, triton_fwd, sdpa) fit and eager does not, so a
# comparison shows the memory FlashAttention saves, not only time.
#   python compare.py configs/shakespeare_long.py --max_memory_gb=12
#
# Sized by estimate (bf16 autocast, 8,192 tokens per micro-batch; the
# dense vocabulary's 11,776 padded logits per token):
#   weights, gradients and AdamW moments, fp32: ~19M parameters x 16 bytes    0.3 GiB
#   activations kept for backward besides attention's: the blocks' ~1 GiB and the
#     logits (bf16) with their fp32 log-softmax, 8,192 x 11,776 x 6 bytes    ~1.5 GiB
#   logit gradients at the start of backward, fp32 and bf16                 ~0.5 GiB
#   -> a FlashAttention backend: about 2.5 GiB, whatever block_size is
#   eager also keeps, per layer, the fp32 scores (for the logsumexp), the fp32 and the bf16
#   probabilities: 10 bytes x batch_size x n_head x block_size^2 x n_layer
#     = 30 GiB at block_size 4096 (batch_size 2, 12 heads, 8 layers), plus ~3.8 GiB of one
#     layer's score gradients in backward
#   -> eager: about 34 GiB, far over a 12 GB card. At block_size 1024 (batch_size 8) it would
#      be about 8 GiB and fit, at 2048 (batch_size 4) about 15 GiB and not: 4096 is well past
#      the edge. `bash .ci/gpu long` runs eager and the flash backends here on the GPU.
# Everything else is the default run's (TrainConfig, configs/shakespeare.py).
out_dir = "out-shakespeare-long"
block_size = 4096
# 2 x 4096 = 8,192 tokens per micro-batch and per optimizer step, twice the default run's step
# (at one sequence eager's scores would be half the estimate above, still over 12 GB).
batch_size = 2
gradient_accumulation_steps = 1
