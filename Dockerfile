# Placeholder until the packaging issue: builds envoy-agent and runs it on the official Envoy
# 1.40 image. Not yet hardened (non-root, labels, dependency caching).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --locked --release -p envoy-agent

FROM envoyproxy/envoy:v1.40.0
COPY --from=build /src/target/release/envoy-agent /usr/local/bin/envoy-agent
# The entrypoint is the agent alone, so that manifests give it its whole command line.
ENTRYPOINT ["/usr/local/bin/envoy-agent"]
CMD ["run", "--envoy-path", "/usr/local/bin/envoy", "-c", "/etc/envoy/envoy.yaml"]
