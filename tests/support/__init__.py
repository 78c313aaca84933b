"""Support for the tests (and a few benchmarks), importable as ``tests.support.X`` with the
repository root on the path (pytest puts it there: ``pythonpath = ["."]``; launched ranks get it
on PYTHONPATH from the test that starts them). Not part of the installed package.

- `distributed`: N gloo ranks with megatron's parallel state, a function run on each;
- `runs`: the generated sample corpus, tiny model/training flags, `pretrain_leviathan` runs;
- `cluster`: torchrun jobs for the cluster-resilience tests;
- `jobs`: launched jobs signalled and inspected (ranks, agents, workers, pause/resume);
- `once`: session artifacts built once across pytest-xdist workers;
- `tiny_gpt`: a toy GPT and random samples for tests that drive `training.pretrain` directly;
- `megatron_doubles`: CPU doubles of megatron-core's CUDA-only training pieces;
- `gpt2_bpe`: a small GPT-2 style vocab.json / merges.txt pair;
- `memory`: the bytes an autograd graph saves for backward.
"""
