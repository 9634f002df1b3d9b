//! Helpers shared by the tests (spawning plugins, checking for leaks).
