# The default GPU run: a 6-layer GPT (10.6M parameters besides the 19.3M of its tied
# token embedding) on TinyShakespeare's GPT-2 tokens, sized to fit a 12 GB card with every
# attention backend, eager included. Its values are train.py's defaults, spelled out here.
#   python train.py configs/shakespeare.py --attn=triton
out_dir = "out-shakespeare"
eval_interval = 250
eval_iters = 200
log_interval = 10
# 30M parameters on 302k training tokens can overfit: keep the checkpoint with the best
# val loss rather than the latest.
always_save_checkpoint = False

n_layer = 6
n_head = 6
n_embd = 384  # head dim 64, within the Triton kernels' 16/32/64/128
block_size = 256
dropout = 0.2
bias = False

# 32 x 256 tokens per micro-batch keeps the 50,304-wide logits (and their fp32 softmax for
# the loss) to a few GB; two micro-batches make 16,384 tokens per optimizer step.
batch_size = 32
gradient_accumulation_steps = 2

learning_rate = 1e-3
max_iters = 2000
lr_decay_iters = 2000
min_lr = 1e-4
warmup_iters = 100
beta2 = 0.99
