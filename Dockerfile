# envoy-agent on the official Envoy 1.40 image: the agent is PID 1 and starts Envoy.
#
#   docker build -t envoy-agent:0.1.0 .
#   docker run --rm -v $PWD/examples/bootstrap.yaml:/etc/envoy/envoy.yaml:ro envoy-agent:0.1.0

# --- build: dependencies first (a layer that only changes with Cargo.lock), then the sources.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY agent/Cargo.toml agent/
COPY proxy/Cargo.toml proxy/
COPY drain/Cargo.toml drain/
COPY hotrestart/Cargo.toml hotrestart/
COPY proto/Cargo.toml proto/
COPY tests/Cargo.toml tests/
RUN for c in agent proxy drain hotrestart proto tests; do mkdir -p $c/src && touch $c/src/lib.rs; done \
 && echo 'fn main() {}' > agent/src/main.rs \
 && echo 'fn main() {}' > proto/build.rs \
 && cargo build --locked --release -p envoy-agent \
 && rm -rf agent/src proxy/src drain/src hotrestart/src proto/src proto/build.rs tests/src
COPY . .
# Cargo compares timestamps: make sure the real sources are newer than the placeholders.
RUN find agent proxy drain hotrestart proto tests -name '*.rs' -exec touch {} + \
 && cargo build --locked --release -p envoy-agent \
 && strip target/release/envoy-agent

# --- run: the official Envoy image, the agent beside Envoy.
FROM envoyproxy/envoy:v1.40.0
LABEL org.opencontainers.image.title="envoy-agent" \
      org.opencontainers.image.description="Process manager for the Envoy proxy: start, drain, hot restart, gRPC status" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /src/target/release/envoy-agent /usr/local/bin/envoy-agent
# The image's unprivileged user (uid 101). Hot restart needs /dev/shm and the state dir to be
# writable by it; nothing in the agent needs root.
USER envoy
# The agent alone is the entrypoint (PID 1: it reaps and handles signals); manifests give it
# its whole command line.
ENTRYPOINT ["/usr/local/bin/envoy-agent"]
CMD ["run", "--envoy-path", "/usr/local/bin/envoy", "-c", "/etc/envoy/envoy.yaml", "--status-address", "0.0.0.0:15020"]
