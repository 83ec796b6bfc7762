//! HTTP bootstrap server and client (being built).
