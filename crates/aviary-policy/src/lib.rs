//! Aviary's policy guard (being written).
#![forbid(unsafe_code)]
