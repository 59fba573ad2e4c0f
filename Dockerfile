# llmcluster on the PyTorch CUDA runtime image: one image for both schedulers.
#   docker build -t llmcluster:0.1 .
#   Slurm (pyxis/enroot):  llmcluster launch ... --scheduler slurm --image llmcluster:0.1
#   Kubernetes:            llmcluster launch ... --scheduler k8s --image registry.example.com/llmcluster:0.1
# torch comes from the base image (CUDA build, NCCL included); pip must not replace it with another build.
# The base's torch must be at least llmcluster's floor (llmcluster/floor.py; tests/test_compat.py checks this
# line). 2.6 + CUDA 12.4 runs on drivers >= 550. `-runtime` has no C compiler, which torch.compile needs at
# run time (Triton builds a C launcher per kernel, inductor's CPU backend builds C++): gcc/g++ are added here.
# Without them the trainer runs eager and says so once.
ARG BASE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
FROM ${BASE}

RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    LLMCLUSTER_STORAGE=/storage

WORKDIR /opt/llmcluster
# dependencies first (cached layer), then the package
COPY pyproject.toml README.md ./
COPY llmcluster ./llmcluster
RUN python -m pip install --no-deps -e . \
 && python -m pip install "numpy>=1.26" "pydantic>=2.6" "PyYAML>=6.0" "rich>=13.7" "tokenizers>=0.19" \
        "safetensors>=0.4" "prometheus-client>=0.20" "nvidia-ml-py>=12.535" "matplotlib>=3.8" \
 && python -c "import torch, llmcluster; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# the Kubernetes manifests run as uid 1000 (runAsNonRoot); Slurm/pyxis runs as the submitting user
RUN useradd --uid 1000 --create-home --shell /bin/bash llm && mkdir -p /storage && chown llm /storage
USER 1000
WORKDIR /storage
ENTRYPOINT []
CMD ["llmcluster", "--help"]
