# The kvmesh-sidecar image: a release build on a slim Debian base,
# run as an unprivileged user (the Deployment also requires non-root and a
# read-only root filesystem). Build from the repository root:
#
#   docker build -f envoy/istio/images/sidecar.Dockerfile -t REGISTRY/kvmesh/kvmesh-sidecar:0.1.0 .
#
# The toolchain is the one of rust-toolchain.toml.
FROM rust:1.95.0-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvmesh-sidecar \
    && install -D target/release/kvmesh-sidecar /out/kvmesh-sidecar

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/kvmesh-sidecar /usr/local/bin/kvmesh-sidecar
USER 65532:65532
EXPOSE 50051 9902
ENTRYPOINT ["/usr/local/bin/kvmesh-sidecar"]
