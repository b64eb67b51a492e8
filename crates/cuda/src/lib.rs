//! baton-cuda
