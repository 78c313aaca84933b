"""Megatron-Core extension for Leviathan language models."""
