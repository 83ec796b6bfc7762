//! kvx-bootstrap (to be built; see the issues).
