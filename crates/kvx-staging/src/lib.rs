//! kvx-staging (to be built; see the issues).
