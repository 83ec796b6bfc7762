//! Shared helpers for the kvx benchmarks.
