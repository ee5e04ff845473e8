# The control-plane image: operator, gateway and sync sidecar (`rollfleet <subcommand>`).
# Engines use engine_image/Dockerfile.{cpu,gpu}. Built by `make images` (hack/images.sh),
# which passes BASE_IMAGE where no registry is reachable; users get the public default.
ARG BASE_IMAGE=python:3.11-slim

# Two layers: the dependencies, and the project (a few MiB). A change to the code then sends kind's
# nodes (and a registry) the project's layer alone, not the whole environment again (about 200 MiB).
FROM ${BASE_IMAGE} AS deps
RUN python -m venv /opt/rollfleet
# Dependencies first: editing the code does not re-download them.
COPY pyproject.toml README.md /src/
RUN cd /src && python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
      > /tmp/requirements.txt \
 && /opt/rollfleet/bin/pip install --no-cache-dir -q -r /tmp/requirements.txt \
 && /opt/rollfleet/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib", vars={"base": "/opt/rollfleet-app"}))' \
      > "$(/opt/rollfleet/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/rollfleet-app.pth"

FROM deps AS build
COPY operator /src/operator
COPY engine_image /src/engine_image
COPY client /src/client
RUN /opt/rollfleet/bin/pip install --no-cache-dir -q --no-deps --prefix /opt/rollfleet-app /src

FROM ${BASE_IMAGE}
# Non-root, no shell needed at runtime. The user has a passwd entry: libraries ask for its
# name (kopf's identity calls getpass.getuser(), which fails for a uid the system does not know).
RUN useradd --uid 65532 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin rollfleet
COPY --from=deps /opt/rollfleet /opt/rollfleet
COPY --from=build /opt/rollfleet-app /opt/rollfleet-app
ENV PATH=/opt/rollfleet-app/bin:/opt/rollfleet/bin:$PATH
USER 65532:65532
ENTRYPOINT ["rollfleet"]
