"""Inference on training checkpoints: loading any checkpoint at any layout (evaluation,
generation and conversion build on it)."""
