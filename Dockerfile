# The control-plane image: operator, gateway and sync sidecar (`rollfleet <subcommand>`).
# Engines use engine_image/Dockerfile.{cpu,gpu}. Built by `make images` (hack/images.sh),
# which passes BASE_IMAGE where no registry is reachable; users get the public default.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
RUN python -m venv /opt/rollfleet
# Dependencies first: editing the code does not re-download them.
COPY pyproject.toml README.md /src/
RUN cd /src && python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
      > /tmp/requirements.txt \
 && /opt/rollfleet/bin/pip install --no-cache-dir -q -r /tmp/requirements.txt
COPY operator /src/operator
COPY engine_image /src/engine_image
COPY client /src/client
RUN /opt/rollfleet/bin/pip install --no-cache-dir -q --no-deps /src

FROM ${BASE_IMAGE}
COPY --from=build /opt/rollfleet /opt/rollfleet
ENV PATH=/opt/rollfleet/bin:$PATH
# Non-root, no shell needed at runtime. The user has a passwd entry: libraries ask for its
# name (kopf's identity calls getpass.getuser(), which fails for a uid the system does not know).
RUN useradd --uid 65532 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin rollfleet
USER 65532:65532
ENTRYPOINT ["rollfleet"]
