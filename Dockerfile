# Leviathan training image: NVIDIA's NGC PyTorch container (CUDA, cuDNN, NCCL, Transformer
# Engine, apex, Triton) plus this package.
#
#   docker build -t leviathan .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 -v $PWD/data:/data leviathan \
#       torchrun --nproc-per-node 8 pretrain_leviathan.py --model-size 1.2b ...
#
# Why 25.12-py3: megatron-core 0.16.1 needs torch >= 2.6 and Python >= 3.10 and is tested with
# Transformer Engine >= 2.9, < 2.12 built for CUDA 13 (its [dev] extra pins
# transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12); megatron-core releases are built on the
# NGC container of the month before. NGC PyTorch 25.12 (2025-12-22) is CUDA 13.1, PyTorch
# 2.10.0a0, Python 3.12, with TE and apex of the same month. The TE version was not checked on a
# GPU yet: scripts/gpu_check.sh records the torch/TE/apex/Triton versions it finds in its JSON,
# so this tag (or another, --build-arg NGC_TAG=...) is confirmed by one run of it.
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
 && pip install --no-cache-dir sentencepiece tensorboard zstandard tqdm matplotlib tiktoken xxhash \
 && pip install --no-cache-dir --no-deps -e . \
 && python -c "import torch, megatron.core, megatron_ext.lev; print('torch', torch.__version__)"
# (Transformer Engine is not imported here: `docker build` has no GPU, and TE loads the driver.)

COPY tools ./tools
COPY examples ./examples
COPY scripts ./scripts
COPY benchmarks ./benchmarks
COPY pretrain_leviathan.py ./

# megatron-core's communication/computation overlap needs one CUDA work queue, as in Megatron-LM.
ENV CUDA_DEVICE_MAX_CONNECTIONS=1 \
    PYTHONUNBUFFERED=1
CMD ["bash"]
