# kvfabric's container image: the `kvfabric` command, the C library (libkvfabric_ffi) and the
# Python package with its engine connectors, all from the wheel that scripts/build-wheel.sh
# makes, on a slim Debian. docs/deploy.md says how to run it; deploy/compose.yaml runs a
# whole deployment from it.
#
#   docker build -t kvfabric .
#       builds the wheel in a Rust toolchain image (stage `build`), then the runtime image;
#   docker build --target runtime-prebuilt -t kvfabric .
#       the runtime image from a wheel already in dist/ (scripts/build-wheel.sh on a Debian 12
#       host): for machines that reach no image registry for the toolchain image, as
#       scripts/container-test.sh does;
#   docker build --target etcd -t kvfabric-etcd .  /  --target nats -t kvfabric-nats .
#       etcd and NATS from Debian's packages (the versions kvfabric's tests run against), for
#       deploy/compose.yaml on machines without the upstream images.
ARG BASE=docker.io/library/debian:bookworm-slim
ARG RUST=docker.io/library/rust:1-slim-bookworm

# The wheel, built as a release (stripped of debug information, tagged for its glibc).
FROM ${RUST} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv binutils \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN CARGO_TARGET_DIR=/tmp/target scripts/build-wheel.sh

# What every runtime image has: Python for the package (numpy from Debian), a user of its own.
FROM ${BASE} AS runtime-base
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-numpy ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --create-home --home-dir /var/lib/kvfabric --shell /usr/sbin/nologin kvfabric \
 && install -d -o kvfabric -g kvfabric /var/lib/kvfabric/data /var/lib/kvfabric/models \
 && python3 -m venv --system-site-packages /opt/kvfabric
ENV PATH=/opt/kvfabric/bin:$PATH \
    KVFABRIC_DATA_DIR=/var/lib/kvfabric/data \
    KVFABRIC_MODEL_DIR=/var/lib/kvfabric/models
WORKDIR /var/lib/kvfabric
EXPOSE 8000
ENTRYPOINT ["kvfabric"]
CMD ["--help"]

# The runtime image from a wheel in the build context's dist/.
FROM runtime-base AS runtime-prebuilt
COPY dist/kvfabric-*.whl /tmp/dist/
RUN pip install --no-cache-dir --no-deps /tmp/dist/kvfabric-*.whl && rm -rf /tmp/dist \
 && kvfabric --version && python -c "import kvfabric"
USER kvfabric

# etcd for the compose deployment (Debian's etcd-server; etcdctl and curl for health checks).
FROM ${BASE} AS etcd
RUN apt-get update \
 && apt-get install -y --no-install-recommends etcd-server etcd-client \
 && rm -rf /var/lib/apt/lists/*
ENTRYPOINT ["/usr/bin/etcd"]

# NATS for the compose deployment (Debian's nats-server; curl for health checks).
FROM ${BASE} AS nats
RUN apt-get update \
 && apt-get install -y --no-install-recommends nats-server curl \
 && rm -rf /var/lib/apt/lists/*
ENTRYPOINT ["nats-server"]

# The default target: the runtime image from the wheel the build stage made.
FROM runtime-base AS runtime
COPY --from=build /src/dist/kvfabric-*.whl /tmp/dist/
RUN pip install --no-cache-dir --no-deps /tmp/dist/kvfabric-*.whl && rm -rf /tmp/dist \
 && kvfabric --version && python -c "import kvfabric"
USER kvfabric
