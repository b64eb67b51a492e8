//! baton-frontend
