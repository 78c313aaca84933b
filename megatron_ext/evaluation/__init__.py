"""Evaluation of checkpoints: perplexity, frequency-stratified analysis, zero-shot tasks."""
