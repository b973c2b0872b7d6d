//! idem's servers: `idem serve`, the reverse proxy that makes an upstream's
//! unsafe requests idempotent ([`proxy`]: the `idem-layer` tower layer over
//! a forwarding client, with its admin listener), and, with the
//! `middleware` feature, `idem serve-component`, the host of a `wasi:http`
//! component built on idem's `middleware` world ([`middleware`]). Both read
//! the same configuration (`idem_layer::ProxyConfig`) and run on any
//! `idem_engine::Storage`; the `idem` CLI opens the store and starts them.

#![warn(missing_docs)]

pub mod lookup;
#[cfg(feature = "middleware")]
pub mod middleware;
pub mod operator;
pub mod proxy;
