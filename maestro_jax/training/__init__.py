"""Training: the loop (one optimizer step per global batch), checkpoints, metrics."""
