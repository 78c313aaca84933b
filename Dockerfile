# Leviathan training image: NVIDIA's NGC PyTorch container (CUDA, cuDNN, NCCL, Transformer
# Engine, apex, Triton) plus this package.
#
#   docker build -t leviathan .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 -v $PWD/data:/data leviathan \
#       torchrun --nproc-per-node 8 pretrain_leviathan.py --model-size 1.2b ...
#
# Why 25.12-py3: megatron-core 0.16.1 is tested against Transformer Engine >= 2.9 and < 2.12
# built for CUDA 13 (its [dev] extra pins transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12)
# and needs torch >= 2.6 and Python >= 3.10; NGC PyTorch 25.12 ships Python 3.12, a CUDA 13
# build of PyTorch, Transformer Engine 2.10 and apex, and megatron-core releases are built on the
# NGC container of the month before. scripts/gpu_check.sh records the versions it finds in its
# JSON, so a different tag can be checked with --build-arg NGC_TAG=... before it is used.
ARG NGC_TAG=25.12-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

# The NGC image pins its own packages through PIP_CONSTRAINT; our installs must not fight it.
ENV PIP_CONSTRAINT=
WORKDIR /workspace/leviathan
COPY pyproject.toml README.md ./
COPY megatron_ext ./megatron_ext

# Keep NGC's torch, Transformer Engine, apex and Triton: --no-deps on our package (whose
# metadata pins the CPU development torch) and on megatron-core; the pure-Python dependencies
# are installed by name.
RUN pip install --no-cache-dir --no-deps "megatron-core==0.16.1" \
 && pip install --no-cache-dir sentencepiece tensorboard zstandard tqdm matplotlib tiktoken \
 && pip install --no-cache-dir --no-deps -e . \
 && python -c "import torch, transformer_engine, megatron.core, megatron_ext.lev; \
print('torch', torch.__version__, 'TE', transformer_engine.__version__)"

COPY tools ./tools
COPY examples ./examples
COPY scripts ./scripts
COPY benchmarks ./benchmarks
COPY pretrain_leviathan.py ./

# megatron-core's communication/computation overlap needs one CUDA work queue, as in Megatron-LM.
ENV CUDA_DEVICE_MAX_CONNECTIONS=1 \
    PYTHONUNBUFFERED=1
CMD ["bash"]
