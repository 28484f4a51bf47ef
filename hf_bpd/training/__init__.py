"""Training draft heads and rescorers for a base model: distillation, head training, shipping (the
`hf-bpd distill/train-heads/train-ngram/train-rescorer` commands)."""
