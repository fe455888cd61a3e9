# The kvmesh Wasm filter as an OCI artifact, in the image layout Istio users
# ship Wasm modules in (a single layer holding plugin.wasm). Build the module
# first (`just build`), then from the repository root:
#
#   docker build -f envoy/istio/images/filter.Dockerfile -t REGISTRY/kvmesh/kvmesh-filter:0.1.0 .
#
# Kubernetes 1.33+ can mount it into the istio-proxy container as an image
# volume (docs/deploy-istio.md); the module is then at /plugin.wasm in it.
FROM scratch
COPY target/wasm32-wasip1/release/kvmesh_filter.wasm ./plugin.wasm
