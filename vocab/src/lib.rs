//! The vocabulary every kvmesh crate shares, with no dependencies: what the
//! filter, the sidecar, the simulator and the fuzz targets must all spell the
//! same way. Today: the bounds on every field that crosses the wire.
#![forbid(unsafe_code)]

pub mod limits;
