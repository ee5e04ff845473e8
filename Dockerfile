# The control-plane image: operator, gateway and sync sidecar (`rollfleet <subcommand>`).
# Engines use engine_image/Dockerfile.{cpu,gpu}.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator operator
COPY engine_image engine_image
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir /wheels/*.whl && rm -rf /root/.cache
# Non-root, no shell needed at runtime.
USER 65532:65532
ENTRYPOINT ["rollfleet"]
