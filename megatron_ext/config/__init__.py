"""The run's configuration, in one room that imports neither torch nor megatron-core: the flag
mechanism, every part of `RunConfig`, the command line and the one args.json reader and writer.
"""
