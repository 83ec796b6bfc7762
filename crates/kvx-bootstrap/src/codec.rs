//! Sans-IO codec for sglang multipart messages (being built).
