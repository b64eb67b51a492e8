//! baton-ipc
