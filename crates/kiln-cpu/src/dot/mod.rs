//! placeholder, replaced by the dot-kernel work
