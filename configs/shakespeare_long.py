# The default run (configs/shakespeare.py) at a 4096-token context: on a 12 GB card the
# FlashAttention backends fit and eager does not, so a comparison shows the memory saved.
#   python compare.py configs/shakespeare_long.py --max_memory_gb=12
# Estimated, bf16 autocast, 8,192 tokens a micro-batch: a FlashAttention backend needs about
# 2.5 GiB whatever block_size is (weights and AdamW 0.3, activations and logits ~1.5, logit
# gradients ~0.5). Eager also keeps each layer's fp32 scores and fp32 and bf16 probabilities,
# 10 bytes x batch_size x n_head x block_size^2 x n_layer = 30 GiB here, about 34 GiB in all;
# at block_size 1024 it would fit (~8 GiB), at 2048 not (~15 GiB).
out_dir = "out-shakespeare-long"
block_size = 4096
# 8,192 tokens a step, twice the default run's (one sequence would still be over 12 GB for eager).
batch_size = 2
gradient_accumulation_steps = 1
