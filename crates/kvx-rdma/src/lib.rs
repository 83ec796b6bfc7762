//! kvx-rdma (to be built; see the issues).
