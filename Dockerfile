# syntax=docker/dockerfile:1
# bgeserve, CPU image (linux/amd64 and linux/arm64): ONNX Runtime's CPU provider.
#   docker build -t bgeserve .
#   docker run --rm -p 8081:8081 -v bgeserve-cache:/cache bgeserve
# Models are downloaded into the /cache volume on first start (HF_HOME=/cache/huggingface) and
# prepared there (BGE_M3_CACHE_DIR=/cache), or mount a local export and set BGE_M3_MODEL_PATH.
# See docs/deployment.md.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY bgeserve ./bgeserve
# The README's install, without -e: the serving dependencies only (no torch, no extras).
RUN pip install .

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    BGE_M3_CACHE_DIR=/cache \
    BGE_M3_BIND=0.0.0.0:8081 \
    HF_HOME=/cache/huggingface
# uid/gid 10002: match it in an EFS access point or a pod's fsGroup so /cache is writable.
RUN groupadd --system --gid 10002 bge \
    && useradd --system --uid 10002 --gid bge --no-create-home --shell /usr/sbin/nologin bge \
    && mkdir -p /cache \
    && chown bge:bge /cache
COPY --from=build /opt/venv /opt/venv
COPY --chmod=0755 healthcheck.sh /usr/local/bin/healthcheck.sh
USER bge
VOLUME ["/cache"]
EXPOSE 8081
# /health answers 200 once the sessions are loaded (the memory probe then runs in the
# background). The start period covers a first start: the model's download (~2.3 GB), preparing
# bgeserve's graphs from it (minutes on 2 cores; docs/prepare.md; cached in /cache after) and
# loading; failures during it do not count.
HEALTHCHECK --interval=10s --timeout=5s --start-period=1200s --retries=3 \
    CMD ["/usr/local/bin/healthcheck.sh"]
CMD ["bgeserve", "serve"]
