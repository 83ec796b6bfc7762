//! Shared helpers for the kvx benchmarks.

#![warn(missing_docs)]
