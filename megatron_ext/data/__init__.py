"""Data pipeline: tokenizers (tokenizers), streaming preprocessing to Megatron-Core indexed
datasets (preprocess, indexed), tokenizer training, a sample corpus and training-data loading
(loading). See docs/data.md."""
