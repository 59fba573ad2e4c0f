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
# Dependencies first (a cached layer): pyproject.toml's own list, read from it (scripts/image_deps.py), without
# torch; the constraint holds pip to the base's torch, so no dependency can pull another build over it.
COPY pyproject.toml README.md ./
COPY scripts/image_deps.py ./scripts/
RUN python scripts/image_deps.py pyproject.toml > /tmp/requirements.txt \
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
