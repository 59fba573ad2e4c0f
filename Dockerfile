# llmcluster on the PyTorch CUDA runtime image: one image for both schedulers.
#   docker build -t llmcluster:0.1 .
#   Slurm (pyxis/enroot):  llmcluster launch ... --scheduler slurm --image llmcluster:0.1
#   Kubernetes:            llmcluster launch ... --scheduler k8s --image registry.example.com/llmcluster:0.1
# torch comes from the base image (CUDA build, NCCL included); pip must not replace it with another build.
# The base is PyTorch's own image of torch 2.13 (CUDA 13.0): the torch train.float8's torchao 0.18 is tested
# with (train/float8.py) and above torchft's 2.7 floor, so every feature a job enables runs in it. CUDA 13.0
# needs NVIDIA driver >= 580.65.06 (llmcluster/floor.py CUDA_MIN_DRIVER). The floor stays a variant of its own,
# on drivers >= 550 (torch 2.6 + CUDA 12.4), without ft and float8 (their torch floors are above it):
#   docker build --build-arg BASE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime \
#                --build-arg EXTRAS=tensorboard,wandb,mlflow,hf -t llmcluster:0.1-floor .
# Both base tags are checked here (tests/test_compat.py, tests/test_image.py). `-runtime` has no C compiler,
# which torch.compile needs at run time (Triton builds a C launcher per kernel, inductor's CPU backend builds
# C++): gcc/g++ are added here. Without them the trainer runs eager and says so once.
ARG BASE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
FROM ${BASE}
# The extras a job enables (pyproject.toml's optional dependencies): ft.enabled (torchft), train.float8
# (torchao), the tracking sinks log.tensorboard / log.wandb / log.mlflow, and hf (export/import with transformers).
ARG EXTRAS=ft,float8,tensorboard,wandb,mlflow,hf

RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    LLMCLUSTER_STORAGE=/storage

WORKDIR /opt/llmcluster
# Dependencies first (a cached layer): pyproject.toml's own list and its EXTRAS', read from it
# (scripts/image_deps.py), without torch; the constraint holds pip to the base's torch, so no dependency
# (torchft, torchao) can pull another build over it.
COPY pyproject.toml README.md ./
COPY scripts/image_deps.py ./scripts/
RUN python scripts/image_deps.py pyproject.toml "$EXTRAS" > /tmp/requirements.txt \
 && python -c "import torch; print('torch==' + torch.__version__)" > /tmp/constraints.txt \
 && python -m pip install -r /tmp/requirements.txt -c /tmp/constraints.txt \
 && rm /tmp/requirements.txt /tmp/constraints.txt
COPY llmcluster ./llmcluster
RUN python -m pip install --no-deps -e . \
 && python -c "import torch, llmcluster; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# The Kubernetes pods run as job.k8s.run_as_user (10000, runAsNonRoot; their HOME is the /tmp emptyDir under a
# read-only root); Slurm/pyxis runs as the submitting user. The image's own user is the pods' uid, with a home.
RUN groupadd --gid 10000 llm \
 && useradd --uid 10000 --gid 10000 --create-home --home-dir /home/llm --shell /bin/bash llm \
 && mkdir -p /storage && chown llm:llm /storage
USER 10000
WORKDIR /storage
ENTRYPOINT []
CMD ["llmcluster", "--help"]
