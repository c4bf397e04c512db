//! Workspace-level tests live in the `[[test]]` targets of this package; see Cargo.toml.
