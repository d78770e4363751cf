# syntax=docker/dockerfile:1
# The one image every pdserve service runs (compose.yaml), in two variants:
#
#   docker build --target cpu -t pdserve:cpu .   torch 2.13.0 CPU wheel; the router always uses this one
#   docker build --target gpu -t pdserve:gpu .   torch 2.13.0 CUDA wheel (CUDA libraries come with it) + triton;
#                                                the host needs the NVIDIA driver and Container Toolkit
#
# The image holds what the code imports and nothing else (tests/deploy/test_image_contents.py checks the
# dependency lists against the imports): no cupy, which no code imports (KV moves between GPUs through torch).
#
# The entry point is `pdserve`; every flag defaults from PDSERVE_<FLAG>, so compose configures it through the
# environment. Models are fetched into PDSERVE_CACHE_DIR (/cache, a named volume in compose.yaml), Hugging Face
# repo ids into HF_HOME (/cache/huggingface); your own weights can be mounted at /models.
# torch is installed before the sources are copied, so a code change does not download it again.
ARG PYTHON_VERSION=3.12

# the package folders map to pdserve.* (pyproject's package-dir); tests and benchmarks stay out
FROM scratch AS src
COPY pyproject.toml README.md /
COPY pdserve /pdserve
COPY engine /engine
COPY kernels /kernels
COPY cache_store /cache_store
COPY kv_transfer /kv_transfer
COPY prefill_node /prefill_node
COPY decode_node /decode_node
COPY router /router
COPY protocol /protocol
COPY worker /worker
COPY bench /bench
COPY planner /planner

FROM python:${PYTHON_VERSION}-slim AS base
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PDSERVE_CACHE_DIR=/cache \
    HF_HOME=/cache/huggingface
RUN useradd --create-home --uid 1000 pdserve && mkdir -p /cache /models && chown pdserve:pdserve /cache /models
EXPOSE 8000 8100 8200
ENTRYPOINT ["pdserve"]
CMD ["serve", "--host", "0.0.0.0"]

FROM base AS cpu
# from the CPU index: pip would otherwise pull the multi-GB CUDA wheel from PyPI
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY --from=src / /src/
RUN pip install /src && rm -rf /src
USER pdserve

FROM base AS gpu
# Triton compiles its kernel launcher with the system C compiler at run time
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN pip install torch==2.13.0 triton==3.8.0
COPY --from=src / /src/
RUN pip install "/src[gpu]" && rm -rf /src
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER pdserve
