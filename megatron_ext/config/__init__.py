"""The run's configuration, in one room that imports neither torch nor megatron-core: the flag
mechanism (`flags`), every part of `RunConfig` (`run`, `layout`, `model`, `lev`, `data`,
`rampup`), the command line with Megatron-LM's flags (`arguments`, `megatron_compat`,
`megatron_flags`) and the one reader of a checkpoint's args.json (`arguments`).
"""
