"""Checkpoint conversion: Hugging Face Llama export/import, Megatron-LM legacy export and offline
resharding (driven by `tools/convert_checkpoint.py`, documented in docs/convert.md)."""
