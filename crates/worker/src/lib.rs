//! baton-worker
