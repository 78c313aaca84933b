"""Megatron-Core extension for Leviathan language models."""

import logging as _logging

# megatron-core announces Megatron-FSDP at INFO ("Detected Megatron Core, using Megatron-FSDP
# with Megatron.", twice) whenever anything imports its distributed package; this project never
# uses Megatron-FSDP, so every tool's output would start with that noise.
_logging.getLogger("megatron.core.distributed.fsdp").setLevel(_logging.WARNING)
