//! The shipped component itself: what it imports and how loading fails.

use anyhow::{Result, bail, ensure};
use idem::{Engine, Error, MemoryStore};

#[test]
fn component_imports_only_idem_interfaces() -> Result<()> {
    let engine = Engine::builder().storage(MemoryStore::new()).build()?;
    let imports = engine.component_imports();
    ensure!(!imports.is_empty());
    for name in &imports {
        ensure!(
            name.starts_with("idem:engine/"),
            "the guest imports {name}, which is not idem's own"
        );
    }
    for wanted in ["store", "clock", "results"] {
        ensure!(
            imports
                .iter()
                .any(|n| n.starts_with(&format!("idem:engine/{wanted}@"))),
            "missing import {wanted}: {imports:?}"
        );
    }
    Ok(())
}

#[test]
fn loading_bytes_that_are_not_a_component_fails_at_build() -> Result<()> {
    match Engine::builder()
        .storage(MemoryStore::new())
        .guest_bytes(b"\0asm not really".to_vec())
        .build()
    {
        Err(Error::Load(msg)) => ensure!(!msg.is_empty()),
        Err(other) => bail!("expected a load error, got {other}"),
        Ok(_) => bail!("garbage must not load"),
    }
    Ok(())
}

#[test]
fn loading_a_missing_file_names_the_file() -> Result<()> {
    match Engine::builder().guest_file("/nonexistent/idem.wasm") {
        Err(Error::Load(msg)) => ensure!(msg.contains("/nonexistent/idem.wasm"), "{msg}"),
        Err(other) => bail!("{other}"),
        Ok(_) => bail!("a missing file must not load"),
    }
    Ok(())
}
