//! The embedded default model: `harrier-cpu`, served when no `--model` is given.
//!
//! `harrier-cpu` is a small Llama (6.8M parameters: 6 layers, hidden 256, 4 query / 2 KV heads,
//! tied embeddings, bf16 weights) trained on Python source, with its own 8192-entry BPE tokenizer,
//! the Llama 3 special tokens (`<|begin_of_text|>` = 0; eos `<|end_of_text|>`, `<|eom_id|>`,
//! `<|eot_id|>` = 1, 8, 9), the Llama 3.1 chat template and a 2048-token context. Its files live
//! in `engine-core/models/harrier-cpu/`; `tests/parity.rs` checks it against transformers.
//!
//! Why embedded: a fresh install (or a CI runner, or a container) can serve, benchmark and test
//! end to end on the CPU with no download and no generation step, and the model it serves is
//! small enough to run anywhere yet produces text a reader can judge. The files are compiled
//! into the binary (about 14 MB) and written out on first use:
//!
//! ```text
//!   $HARRIER_HOME/models/
//!     .harrier-cpu-XXXXXX/      private (0700) temporary directory: every file, then the marker
//!     harrier-cpu/              the temporary directory renamed into place (0755), complete
//!       config.json, generation_config.json, model.safetensors, tokenizer.json,
//!       tokenizer_config.json
//!       .harrier-embedded       "xxh64:<digest of the embedded files>"
//! ```
//!
//! A directory is used only when its marker holds this binary's digest and every file has its
//! embedded length; otherwise (first use, a binary with another embedded model, a damaged
//! directory) a new copy is written and swapped in with renames. Each directory that appears at
//! `harrier-cpu/` is complete, so concurrent starts never see half a model: the loser of a
//! rename race finds the winner's copy ready and drops its own.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use xxhash_rust::xxh64::Xxh64;

/// The directory name, and so the name the model is served as.
pub const NAME: &str = "harrier-cpu";

/// The file inside the written directory that records the digest of the embedded files.
pub const MARKER: &str = ".harrier-embedded";

/// The embedded files, written as they are.
const FILES: [(&str, &[u8]); 5] = [
    (
        "config.json",
        include_bytes!("../models/harrier-cpu/config.json"),
    ),
    (
        "generation_config.json",
        include_bytes!("../models/harrier-cpu/generation_config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../models/harrier-cpu/model.safetensors"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../models/harrier-cpu/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../models/harrier-cpu/tokenizer_config.json"),
    ),
];

/// How many times a lost rename race is retried before giving up.
const INSTALL_ATTEMPTS: usize = 8;

/// The xxh64 of every embedded file's name, length and bytes, in order.
pub fn digest() -> u64 {
    let mut h = Xxh64::new(0);
    for (name, bytes) in FILES {
        h.update(name.as_bytes());
        h.update(&[0]);
        h.update(&(bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    h.digest()
}

/// The marker's contents for this binary.
fn marker_text() -> String {
    format!("xxh64:{:016x}\n", digest())
}

/// Where the model is written under `models` (normally `$HARRIER_HOME/models`).
pub fn dir_in(models: &Path) -> PathBuf {
    models.join(NAME)
}

/// Whether `dir` holds this binary's model: the marker matches and every file has its length.
fn is_current(dir: &Path, marker: &str) -> bool {
    fs::read_to_string(dir.join(MARKER)).is_ok_and(|m| m == marker)
        && FILES.iter().all(|(name, bytes)| {
            fs::metadata(dir.join(name)).is_ok_and(|m| m.is_file() && m.len() == bytes.len() as u64)
        })
}

/// Returns `models/harrier-cpu`, writing the embedded files there first unless they already
/// are (see the module note for the protocol).
pub fn ensure_in(models: &Path) -> anyhow::Result<PathBuf> {
    let dir = dir_in(models);
    let marker = marker_text();
    if is_current(&dir, &marker) {
        return Ok(dir);
    }
    fs::create_dir_all(models).with_context(|| format!("creating {}", models.display()))?;
    tracing::info!(dir = %dir.display(), "writing the embedded default model ({NAME})");
    let tmp = write_private_copy(models, &marker)?;
    let mut last_error = None;
    for _ in 0..INSTALL_ATTEMPTS {
        // rename(2) moves a directory only onto a missing or empty one: it fails while any
        // copy (stale, or a concurrent start's) is in place.
        match fs::rename(tmp.path(), &dir) {
            Ok(()) => {
                // The temporary path is gone: nothing is left for the guard to remove.
                let _ = tmp.keep();
                return Ok(dir);
            }
            Err(e) => last_error = Some(e),
        }
        if is_current(&dir, &marker) {
            return Ok(dir); // a concurrent start won; `tmp` is removed on drop
        }
        // A stale copy: move it aside (one rename, so readers see it whole or not at all),
        // then try again. Losing this race to another start is fine too.
        let aside = tempfile::Builder::new()
            .prefix(&format!(".{NAME}-stale-"))
            .tempdir_in(models)
            .with_context(|| format!("creating a directory in {}", models.display()))?;
        if fs::rename(&dir, aside.path().join(NAME)).is_err() && dir.exists() {
            tracing::warn!(dir = %dir.display(), "could not move a stale default model aside");
        }
        // `aside` (with the stale copy, if it moved) is removed here.
    }
    Err(anyhow::anyhow!(
        "could not install the embedded default model at {} ({INSTALL_ATTEMPTS} attempts; last \
         rename: {})",
        dir.display(),
        last_error.map_or_else(|| "none".to_string(), |e| e.to_string())
    ))
}

/// Writes every file, then the marker, into a new private directory under `models`; its mode
/// becomes 0755 once complete so that other users can read the installed model.
fn write_private_copy(models: &Path, marker: &str) -> anyhow::Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{NAME}-"))
        .permissions(fs::Permissions::from_mode(0o700))
        .tempdir_in(models)
        .with_context(|| format!("creating a temporary directory in {}", models.display()))?;
    let write = |name: &str, bytes: &[u8]| -> anyhow::Result<()> {
        let path = tmp.path().join(name);
        let mut f =
            fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        f.write_all(bytes)
            .and_then(|()| f.sync_all())
            .with_context(|| format!("writing {}", path.display()))
    };
    for (name, bytes) in FILES {
        write(name, bytes)?;
    }
    write(MARKER, marker.as_bytes())?;
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755))
        .with_context(|| format!("setting the mode of {}", tmp.path().display()))?;
    Ok(tmp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelDir;

    #[test]
    fn first_use_writes_a_complete_model_directory() {
        let home = tempfile::tempdir().unwrap();
        let models = home.path().join("models");
        let dir = ensure_in(&models).unwrap();
        assert_eq!(dir, models.join(NAME));
        for (name, bytes) in FILES {
            assert_eq!(fs::read(dir.join(name)).unwrap(), bytes, "{name}");
        }
        assert_eq!(fs::read_to_string(dir.join(MARKER)).unwrap(), marker_text());
        let md = ModelDir::open(&dir).unwrap();
        assert_eq!(md.name, NAME);
        assert_eq!(md.config.vocab_size, 8192);
        assert_eq!(md.config.max_position_embeddings, 2048);
        assert_eq!(md.generation.eos_token_ids, [1, 8, 9]);
        // Only the model directory is left: no temporary or stale copies.
        let entries: Vec<_> = fs::read_dir(&models)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(entries, [NAME]);
    }

    #[test]
    fn a_second_call_reuses_the_directory() {
        let home = tempfile::tempdir().unwrap();
        let models = home.path().join("models");
        let dir = ensure_in(&models).unwrap();
        // A file the writer never makes survives only if the directory is not rewritten.
        fs::write(dir.join("keep-me"), b"x").unwrap();
        assert_eq!(ensure_in(&models).unwrap(), dir);
        assert!(dir.join("keep-me").is_file());
    }

    #[test]
    fn a_stale_or_damaged_directory_is_rewritten() {
        let home = tempfile::tempdir().unwrap();
        let models = home.path().join("models");
        let dir = ensure_in(&models).unwrap();
        // Another binary's model: a different marker (and a leftover file of its own).
        fs::write(dir.join(MARKER), "xxh64:0000000000000000\n").unwrap();
        fs::write(dir.join("stale"), b"x").unwrap();
        assert_eq!(ensure_in(&models).unwrap(), dir);
        assert_eq!(fs::read_to_string(dir.join(MARKER)).unwrap(), marker_text());
        assert!(
            !dir.join("stale").exists(),
            "the stale directory was replaced whole"
        );
        // A truncated weight file under a correct marker.
        fs::write(dir.join("model.safetensors"), b"").unwrap();
        ensure_in(&models).unwrap();
        assert_eq!(
            fs::metadata(dir.join("model.safetensors")).unwrap().len(),
            FILES[2].1.len() as u64
        );
        ModelDir::open(&dir).unwrap();
        let entries: Vec<_> = fs::read_dir(&models)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(entries, [NAME], "stale copies are removed");
    }

    #[test]
    fn concurrent_first_uses_agree() {
        let home = tempfile::tempdir().unwrap();
        let models = home.path().join("models");
        let dirs: Vec<PathBuf> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4).map(|_| s.spawn(|| ensure_in(&models))).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect()
        });
        assert!(dirs.iter().all(|d| *d == models.join(NAME)));
        assert!(is_current(&models.join(NAME), &marker_text()));
        let entries: Vec<_> = fs::read_dir(&models)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(entries, [NAME]);
    }
}
