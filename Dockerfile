# GPU image: NGC PyTorch base with its own torch and Triton kept (pyproject states ranges they satisfy; the CPU
# constraints file is not used here), the project's other pins, and flash-attn built against the image's torch.
#   docker build -t diff-transformer .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 -v $PWD/outputs:/workspace/diff-transformer/outputs \
#       diff-transformer torchrun --nproc_per_node=8 train.py model=1.4b
ARG NGC_TAG=25.10-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

ENV PIP_NO_CACHE_DIR=1 \
    WANDB_MODE=offline \
    PYTHONUNBUFFERED=1
WORKDIR /workspace/diff-transformer

# Dependencies first, so code changes do not rebuild them.
COPY pyproject.toml constraints.txt README.md ./
RUN mkdir -p diff_transformer kernels data launch \
    && touch diff_transformer/__init__.py kernels/__init__.py data/__init__.py launch/__init__.py \
    && pip install -e ".[dev]" \
    && python -c "import torch; assert torch.version.cuda, 'the image lost its CUDA torch'"

# flash-attn compiles against the installed torch (20-40 minutes; MAX_JOBS bounds the compiler's memory).
ARG MAX_JOBS=8
ARG FLASH_ATTN_VERSION=2.8.3
RUN MAX_JOBS=${MAX_JOBS} pip install --no-build-isolation flash-attn==${FLASH_ATTN_VERSION}

COPY . .
RUN pip install --no-deps -e . && python -c "import diff_transformer, kernels, data, megatron.core, flash_attn"
