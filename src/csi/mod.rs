//! CSI v1: the generated protocol types and services ([`proto`]).

/// The CSI v1 protocol (`package csi.v1`), generated at build time from
/// `proto/csi.proto`.
pub mod proto {
    #![allow(clippy::all, clippy::pedantic, missing_docs)]
    tonic::include_proto!("csi.v1");
}

pub mod transport;
