//! The kvmesh gRPC API, package `kvmesh.v1`, generated from
//! `proto/kvmesh/v1/kvmesh.proto` by `kvmesh-proto-codegen` (checked for drift),
//! and (`vocab`) the conversions between the wire and `kvmesh-vocab`'s types.
#![forbid(unsafe_code)]

mod vocab;

/// Messages of `kvmesh.v1`, and with the `grpc` feature its tonic service.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod v1 {
    include!("gen/kvmesh.v1.rs");

    #[cfg(feature = "grpc")]
    include!("gen/kvmesh.v1.tonic.rs");
}

/// Full gRPC method paths, as the filter dispatches them through Envoy.
pub mod method {
    /// `kvmesh.v1.Router` service name.
    pub const SERVICE: &str = "kvmesh.v1.Router";
    /// `Pick` method name.
    pub const PICK: &str = "Pick";
    /// `Report` method name.
    pub const REPORT: &str = "Report";
    /// `PickStream` method name.
    pub const PICK_STREAM: &str = "PickStream";
    /// `ReportStream` method name.
    pub const REPORT_STREAM: &str = "ReportStream";
}
