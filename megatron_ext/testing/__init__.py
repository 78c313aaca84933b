"""Test and benchmark support: the multi-process gloo harness (`testing.distributed`) and
activation-memory measurement (`testing.memory`)."""
