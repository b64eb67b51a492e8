//! baton-scheduler
