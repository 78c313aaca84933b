# Leviathan training image: NVIDIA's NGC PyTorch container (CUDA, NCCL, Transformer Engine,
# apex) plus this package. Build: docker build -t leviathan . ; run with --gpus all.
ARG NGC_TAG=25.10-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

WORKDIR /workspace/leviathan
COPY pyproject.toml README.md ./
COPY megatron_ext ./megatron_ext
COPY tools ./tools
COPY examples ./examples
COPY scripts ./scripts
COPY pretrain_leviathan.py ./

# Keep NGC's own torch, TE and apex: install our package without letting pip replace them.
RUN pip install --no-cache-dir --no-deps -e . \
 && pip install --no-cache-dir "megatron-core==0.16.1" --no-deps \
 && pip install --no-cache-dir numpy sentencepiece tensorboard zstandard tqdm matplotlib tiktoken

ENV CUDA_DEVICE_MAX_CONNECTIONS=1
CMD ["bash"]
