//! ZMQ sockets (being built).
