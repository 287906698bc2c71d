# Placeholder until the packaging issue: builds envoy-agent and runs it as the entrypoint of the
# official Envoy 1.40 image. Not yet hardened (non-root, labels, dependency caching).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --locked --release -p envoy-agent

FROM envoyproxy/envoy:v1.40.0
COPY --from=build /src/target/release/envoy-agent /usr/local/bin/envoy-agent
ENTRYPOINT ["/usr/local/bin/envoy-agent", "run", "--envoy-path", "/usr/local/bin/envoy", "-c", "/etc/envoy/envoy.yaml"]
