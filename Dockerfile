# syntax=docker/dockerfile:1
# envoy-agent on the official Envoy 1.40 image: the agent is PID 1 and starts Envoy.
#
#   docker build -t envoy-agent:0.1.0 .
#   docker run --rm -v "$PWD/examples/bootstrap.yaml:/etc/envoy/envoy.yaml:ro" envoy-agent:0.1.0
#
# The build stage RUNs `scripts/docker-build-stage.sh compile`, the one place that holds the
# cargo command line; CI runs the same script on a clean copy of the repository and checks the
# binary (`scripts/docker-build-stage.sh`), since no Docker engine runs there.

# rust-toolchain.toml's channel: scripts/check-deploy.sh fails when the two differ.
ARG RUST_VERSION=1.95.0

# --- build: on Ubuntu 22.04, the distribution envoyproxy/envoy:v1.40.0 is built on (Envoy's
# distribution/docker/Dockerfile-envoy: BUILD_OS=ubuntu, BUILD_TAG=22.04), so the agent links
# against the glibc (2.35) that the runtime image has. No placeholder crates: cargo loads the
# whole workspace as it is, and BuildKit cache mounts keep the registry and the target dir
# between builds instead of a dependency layer.
FROM ubuntu:22.04 AS build
ARG RUST_VERSION
ENV RUSTUP_HOME=/usr/local/rustup \
    CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# DL3008 (pin apt versions): Ubuntu replaces a package version when it ships a security update,
# so a pinned version stops resolving; the base image tag pins the release instead.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs \
    | sh -s -- -y --no-modify-path --profile minimal --default-toolchain "${RUST_VERSION}" \
 && cargo --version
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    scripts/docker-build-stage.sh compile /out

# --- run: the official Envoy image, the agent beside Envoy.
FROM envoyproxy/envoy:v1.40.0
LABEL org.opencontainers.image.title="envoy-agent" \
      org.opencontainers.image.description="Process manager for the Envoy proxy: start, drain, hot restart, gRPC status" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/envoy-agent /usr/local/bin/envoy-agent
# The image's unprivileged `envoy` user and group, numerically (uid 101, gid 101), so that
# Kubernetes' runAsNonRoot can check it. Hot restart needs /dev/shm and the state dir to be
# writable by it; nothing in the agent needs root.
USER 101:101
# The agent's status server (readiness, /drain, /quitquitquit, /stats/prometheus).
EXPOSE 15020
# The agent alone is the entrypoint (PID 1: it reaps and handles signals); manifests give it
# its whole command line.
ENTRYPOINT ["/usr/local/bin/envoy-agent"]
CMD ["run", "--envoy-path", "/usr/local/bin/envoy", "-c", "/etc/envoy/envoy.yaml", "--status-address", "0.0.0.0:15020"]
