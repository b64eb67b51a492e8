//! baton-model
