//! baton-kv
