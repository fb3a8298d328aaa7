# syntax=docker/dockerfile:1
# lightship CPU serving image: ONNX Runtime behind FastAPI/uvicorn; no torch, no Lightning.
#
#   docker build -t lightship-serve .
#   docker run --rm -p 8000:8000 -v "$PWD/runs/default:/model:ro" lightship-serve
#   docker build --target model --build-arg RUN=runs/default -t lightship-serve:default .
#   docker buildx build --platform linux/amd64,linux/arm64 -t REGISTRY/lightship-serve --push .
#
# Every Python package is pinned in deploy/requirements-serve.txt (deploy/lock.py rewrites it);
# each pin has wheels for linux/amd64 and linux/arm64, so one file builds both.
# deploy/smoke.py replays the builder stage's RUN lines in a fresh virtualenv, then starts the
# server with this file's ENV, ENTRYPOINT and HEALTHCHECK: keep RUN lines free of absolute
# paths (use $VIRTUAL_ENV and paths relative to WORKDIR) so that it can.

# For a reproducible build pin the digest too: python:3.11.15-slim-bookworm@sha256:<index digest>
# (`docker buildx imagetools inspect python:3.11.15-slim-bookworm` prints it).
ARG PYTHON_IMAGE=python:3.11.15-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV VIRTUAL_ENV=/opt/lightship \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Dependencies first, in their own layer: a source edit does not reinstall them.
COPY deploy/requirements-serve.txt deploy/
RUN python -m venv "$VIRTUAL_ENV" \
 && "$VIRTUAL_ENV/bin/pip" install --requirement deploy/requirements-serve.txt
COPY pyproject.toml README.md ./
COPY src/ src/
COPY deploy/healthcheck.py deploy/
# lightship[serve] itself, non-editable, held to the same pins; pip and setuptools are not needed
# at run time (about 25 MB). The HEALTHCHECK's script goes into the virtualenv, on PATH.
# pip's bytecode names its source by mtime: a build that sets the files' times (BuildKit's
# rewrite-timestamp with SOURCE_DATE_EPOCH, for a reproducible image) makes it stale, and the
# server, which may not rewrite it, compiled the ~400 modules it imports from here at every
# start, 1.0-1.5 s more on a 2-core EPYC. Compiled again to be checked against the source's hash
# (6 s; no slower to import). A file that does not compile (a test written for a newer Python)
# is left without bytecode, as pip leaves it, rather than failing the build.
RUN "$VIRTUAL_ENV/bin/pip" install --constraint deploy/requirements-serve.txt ".[serve]" \
 && "$VIRTUAL_ENV/bin/pip" check \
 && "$VIRTUAL_ENV/bin/pip" uninstall --yes pip setuptools \
 && install -m 0755 deploy/healthcheck.py "$VIRTUAL_ENV/bin/lightship-healthcheck" \
 && { "$VIRTUAL_ENV/bin/python" -m compileall -q -f -j 0 --invalidation-mode checked-hash "$VIRTUAL_ENV" \
      || echo "compileall: the files above keep no bytecode"; }

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="lightship-serve" \
      org.opencontainers.image.description="Batched image classification over HTTP (KServe V2), ONNX Runtime on CPU"
# A numeric USER lets Kubernetes' runAsNonRoot verify it without reading /etc/passwd.
RUN useradd --system --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin lightship
COPY --from=builder /opt/lightship /opt/lightship
# python:*-slim deletes the standard library's bytecode (for size), and the server may not write
# it (USER, PYTHONDONTWRITEBYTECODE): each start compiled the ~180 modules it imports. ResNet-18's
# first answer came 1.9-2.4 s after start instead of 1.3 s on a 2-core EPYC. Compiled once here
# (~11 MB), without the tools no server imports, checked by hash as the virtualenv's.
RUN python -m compileall -q -j 0 --invalidation-mode checked-hash \
        -x '/(idlelib|tkinter|turtledemo|lib2to3|pydoc_data|distutils|ensurepip)/' \
        "$(python -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')"
# ORT_DISABLE_TELEMETRY: ONNX Runtime's telemetry looks up mobile.events.data.microsoft.com and
# tries to keep an event store under $HOME (a warning at every start in this image).
ENV VIRTUAL_ENV=/opt/lightship \
    PATH=/opt/lightship/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    ORT_DISABLE_TELEMETRY=1 \
    LIGHTSHIP_RUN=/model \
    LIGHTSHIP_HOST=0.0.0.0 \
    LIGHTSHIP_PORT=8000
USER 10001:10001
EXPOSE 8000
# Ready means the model is loaded and a warm-up batch ran. The slim image has no curl:
# deploy/healthcheck.py asks the port the server uses (`--port` given to `docker run`, else
# LIGHTSHIP_PORT, else 8000).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["lightship-healthcheck"]
# lightship runs as PID 1 and handles SIGTERM itself from its first line (src/lightship/_start.py):
# while starting, exit at once; serving, not ready, drain the queue, exit 0.
ENTRYPOINT ["lightship", "serve"]

# The run directory inside the image (for clusters without a model volume). .dockerignore lets
# only what serving reads into the context: manifest.json, the ONNX models and report.json.
FROM runtime AS model
ARG RUN=runs/default
COPY ${RUN}/ /model/

# The default target: the model is mounted at /model when the container starts.
FROM runtime AS serve
