//! Models by Hugging Face Hub id: `harrier serve meta-llama/Llama-3.2-1B-Instruct`.
//!
//! A `--model` that is not an existing path and looks like `ORG/NAME` is a Hub id. The files a
//! server needs are fetched with the `hf-hub` crate into the standard cache
//! (`$HF_HOME/hub/models--ORG--NAME/{blobs,snapshots/<commit>,refs/<revision>}`, shared with
//! Python's huggingface_hub), so a second start, or `HF_HUB_OFFLINE=1`, reads the cache with no
//! network. Settings as huggingface_hub reads them: `HF_ENDPOINT`, `HF_HOME`, `HF_TOKEN` (else
//! `$HF_HOME/token`), `HF_HUB_OFFLINE`; `--revision` picks a branch, tag or commit.
//!
//! Only what serving reads is fetched: `config.json`, `tokenizer.json` and the weights
//! (`model.safetensors.index.json` and the shards it names, or `model.safetensors`), plus
//! `generation_config.json`, `tokenizer_config.json`, `chat_template.jinja` and
//! `chat_template.json` where the repository has them. A download continues where a cut one
//! stopped (the partial file stays in the cache; the next request asks for the rest with a
//! `Range`), and a finished one is checked (JSON parses; a safetensors file's header and length
//! agree) before it is used. A progress bar on a terminal, log lines (every 10%) otherwise.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::api::Progress;
use hf_hub::{Cache, Repo, RepoType};

use crate::progress::{StartupProgress, Unit};

/// Files fetched when the repository has them (a 404 is not an error).
const OPTIONAL_FILES: &[&str] = &[
    "generation_config.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
];
const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";
/// Attempts per file: a cut connection is retried, each time from the last byte received.
const ATTEMPTS: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("{repo} (revision {revision}) needs authorisation ({status}): set HF_TOKEN to a token that can read it, or run `huggingface-cli login`")]
    Unauthorized {
        repo: String,
        revision: String,
        status: u16,
    },
    #[error("{repo} has no file {file} at revision {revision} (404 from {endpoint}); check the model id and --revision (no local directory has that name either)")]
    NotFound {
        repo: String,
        revision: String,
        file: String,
        endpoint: String,
    },
    #[error("HF_HUB_OFFLINE is set and {file} of {repo} (revision {revision}) is not in the cache {cache}")]
    NotCached {
        repo: String,
        revision: String,
        file: String,
        cache: String,
    },
    #[error("downloading {file} of {repo}: {message}")]
    Download {
        repo: String,
        file: String,
        message: String,
    },
    #[error("{file} of {repo} is damaged after download ({problem}); it was removed from the cache, try again")]
    Damaged {
        repo: String,
        file: String,
        problem: String,
    },
    #[error("{repo} changed while it was downloading (files from commits {a} and {b}); try again")]
    Moved { repo: String, a: String, b: String },
}

/// Where and how to reach the Hub.
#[derive(Debug, Clone)]
pub struct HubConfig {
    pub endpoint: String,
    /// The cache root (`$HF_HOME/hub`).
    pub cache_dir: PathBuf,
    pub token: Option<String>,
    pub offline: bool,
    /// A progress bar (else log lines).
    pub progress_bar: bool,
}

impl HubConfig {
    /// As huggingface_hub reads the environment.
    pub fn from_env() -> HubConfig {
        let cache = Cache::from_env();
        let flag = |k: &str| {
            std::env::var(k).is_ok_and(|v| {
                matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
            })
        };
        HubConfig {
            endpoint: std::env::var("HF_ENDPOINT")
                .ok()
                .filter(|e| !e.is_empty())
                .map(|e| e.trim_end_matches('/').to_string())
                .unwrap_or_else(|| "https://huggingface.co".into()),
            token: std::env::var("HF_TOKEN")
                .ok()
                .filter(|t| !t.is_empty())
                .or_else(|| cache.token()),
            cache_dir: cache.path().clone(),
            offline: flag("HF_HUB_OFFLINE"),
            progress_bar: std::io::stderr().is_terminal(),
        }
    }
}

/// Whether `spec` names a Hub model rather than a local directory: not an existing path, and
/// `ORG/NAME` with the Hub's characters (letters, digits, `-`, `_`, `.`; no `..`).
pub fn is_hub_id(spec: &str) -> bool {
    if Path::new(spec).exists() || spec.contains("..") {
        return false;
    }
    let ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 96
            && !s.starts_with(['.', '-'])
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    matches!(spec.split_once('/'), Some((org, name)) if ok(org) && ok(name))
}

/// A fetched model: the snapshot directory holding its files.
#[derive(Debug, Clone)]
pub struct HubModel {
    pub dir: PathBuf,
    pub repo_id: String,
    pub revision: String,
}

/// Fetches (or finds in the cache) the files of `repo_id` at `revision` that serving needs.
pub fn fetch(cfg: &HubConfig, repo_id: &str, revision: Option<&str>) -> Result<HubModel, HubError> {
    let revision = revision.unwrap_or("main").to_string();
    let repo = Repo::with_revision(repo_id.to_string(), RepoType::Model, revision.clone());
    let fetcher = Fetcher::new(cfg, repo, repo_id, &revision);
    let config = fetcher.required("config.json")?;
    let dir = config
        .parent()
        .expect("a cached file has a parent")
        .to_path_buf();
    let fetcher = Fetcher {
        commit: Some(name_of(&dir)),
        ..fetcher
    };
    let mut files = vec![config, fetcher.required("tokenizer.json")?];
    for f in OPTIONAL_FILES {
        files.extend(fetcher.optional(f)?);
    }
    // Sharded or single weights; a cached single file means there is no index to ask for.
    let index = match fetcher.cache.get(SINGLE) {
        Some(_) => None,
        None => fetcher.optional(INDEX)?,
    };
    match index {
        Some(index) => {
            for shard in
                shards(&index).map_err(|problem| fetcher.damaged(INDEX, &index, problem))?
            {
                files.push(fetcher.required(&shard)?);
            }
            files.push(index);
        }
        None => files.push(fetcher.required(SINGLE)?),
    }
    for f in &files {
        let parent = f.parent().expect("a cached file has a parent");
        if parent != dir {
            return Err(HubError::Moved {
                repo: repo_id.into(),
                a: name_of(&dir),
                b: name_of(parent),
            });
        }
    }
    tracing::info!(repo = repo_id, %revision, dir = %dir.display(), files = files.len(), "model ready");
    Ok(HubModel {
        dir,
        repo_id: repo_id.into(),
        revision,
    })
}

fn name_of(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The shard files a safetensors index names (sorted, each once; plain file names only).
fn shards(index: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(index).map_err(|e| e.to_string())?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let map = v["weight_map"].as_object().ok_or("no weight_map object")?;
    let mut out: Vec<String> = map
        .values()
        .map(|f| {
            f.as_str()
                .map(str::to_string)
                .ok_or("a weight_map entry is not a string")
        })
        .collect::<Result<_, _>>()?;
    out.sort();
    out.dedup();
    if let Some(bad) = out
        .iter()
        .find(|f| f.contains('/') || f.contains("..") || !f.ends_with(".safetensors"))
    {
        return Err(format!(
            "weight_map names {bad:?}, not a .safetensors file beside the index"
        ));
    }
    Ok(out)
}

struct Fetcher<'a> {
    cfg: &'a HubConfig,
    cache: hf_hub::CacheRepo,
    api: Option<ApiRepo>,
    repo_id: &'a str,
    revision: &'a str,
    /// The snapshot's commit once known: where absent optional files are recorded.
    commit: Option<String>,
}

impl<'a> Fetcher<'a> {
    fn new(cfg: &'a HubConfig, repo: Repo, repo_id: &'a str, revision: &'a str) -> Self {
        let cache = Cache::new(cfg.cache_dir.clone()).repo(repo.clone());
        let api = (!cfg.offline).then(|| {
            ApiBuilder::from_cache(Cache::new(cfg.cache_dir.clone()))
                .with_endpoint(cfg.endpoint.clone())
                .with_token(cfg.token.clone())
                .with_progress(false)
                .with_retries(0)
                .build()
                .map(|api| api.repo(repo))
        });
        Fetcher {
            cfg,
            cache,
            // Building the client fails only when TLS cannot be set up; downloads then fail
            // with that message.
            api: api.and_then(|r| {
                r.map_err(|e| tracing::error!(error = %e, "cannot set up the Hub client"))
                    .ok()
            }),
            repo_id,
            revision,
            commit: None,
        }
    }

    /// huggingface_hub's record of a file the repository lacks at a commit
    /// (`.no_exist/<commit>/<file>`), so that later starts do not ask again.
    fn no_exist(&self, file: &str) -> Option<PathBuf> {
        let commit = self.commit.as_ref()?;
        let repo_dir = self
            .cfg
            .cache_dir
            .join(format!("models--{}", self.repo_id.replace('/', "--")));
        Some(repo_dir.join(".no_exist").join(commit).join(file))
    }

    fn required(&self, file: &str) -> Result<PathBuf, HubError> {
        self.optional(file)?.ok_or_else(|| HubError::NotFound {
            repo: self.repo_id.into(),
            revision: self.revision.into(),
            file: file.into(),
            endpoint: self.cfg.endpoint.clone(),
        })
    }

    /// The file's cached path, downloading it first unless it is cached; `None` on a 404 (or,
    /// offline, when the cache lacks an optional file).
    fn optional(&self, file: &str) -> Result<Option<PathBuf>, HubError> {
        if let Some(p) = self.cache.get(file) {
            return Ok(Some(p));
        }
        if self.no_exist(file).is_some_and(|p| p.exists()) {
            return Ok(None);
        }
        let Some(api) = &self.api else {
            if self.cfg.offline {
                if OPTIONAL_FILES.contains(&file) || file == INDEX {
                    return Ok(None);
                }
                return Err(HubError::NotCached {
                    repo: self.repo_id.into(),
                    revision: self.revision.into(),
                    file: file.into(),
                    cache: self.cfg.cache_dir.display().to_string(),
                });
            }
            return Err(self.download_error(file, "the Hub client could not be set up".into()));
        };
        let mut last = String::new();
        for attempt in 1..=ATTEMPTS {
            let progress = ProgressReport::new(file, self.cfg.progress_bar);
            match api.download_with_progress(file, progress) {
                Ok(path) => {
                    if let Err(problem) = check_file(&path) {
                        return Err(self.damaged(file, &path, problem));
                    }
                    return Ok(Some(path));
                }
                Err(ApiError::RequestError(e)) => match *e {
                    ureq::Error::Status(404, _) => {
                        if let Some(p) = self.no_exist(file) {
                            let _ = p.parent().map(std::fs::create_dir_all);
                            let _ = std::fs::File::create(p);
                        }
                        return Ok(None);
                    }
                    ureq::Error::Status(status @ (401 | 403), _) => {
                        return Err(HubError::Unauthorized {
                            repo: self.repo_id.into(),
                            revision: self.revision.into(),
                            status,
                        })
                    }
                    ureq::Error::Status(status, _) => {
                        last = format!("HTTP {status} from {}", self.cfg.endpoint)
                    }
                    ureq::Error::Transport(t) => last = t.to_string(),
                },
                Err(e) => last = e.to_string(),
            }
            tracing::warn!(file, attempt, error = %last, "download interrupted; retrying from where it stopped");
            std::thread::sleep(std::time::Duration::from_millis(200 * attempt as u64));
        }
        Err(self.download_error(file, last))
    }

    fn download_error(&self, file: &str, message: String) -> HubError {
        HubError::Download {
            repo: self.repo_id.into(),
            file: file.into(),
            message,
        }
    }

    /// Removes a damaged file (its snapshot link and the blob) so the next start fetches it.
    fn damaged(&self, file: &str, path: &Path, problem: String) -> HubError {
        if let Ok(blob) = std::fs::canonicalize(path) {
            let _ = std::fs::remove_file(blob);
        }
        let _ = std::fs::remove_file(path);
        HubError::Damaged {
            repo: self.repo_id.into(),
            file: file.into(),
            problem,
        }
    }
}

/// A downloaded file is whole: JSON parses; a safetensors header fits and its tensors end
/// exactly at the end of the file.
fn check_file(path: &Path) -> Result<(), String> {
    let name = path.to_string_lossy();
    if name.ends_with(".json") {
        let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
        serde_json::from_slice::<serde_json::Value>(&bytes)
            .map_err(|e| format!("invalid JSON: {e}"))?;
    } else if name.ends_with(".safetensors") {
        let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
        // SAFETY: the cache file is not modified while mapped (the download that wrote it has
        // finished and holds its lock until now; nothing else writes blobs in place).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| e.to_string())?;
        // Our range check first: the crate adds ranges up unchecked (docs/fuzzing.md).
        crate::model::check_data_offsets(&map)?;
        safetensors::SafeTensors::deserialize(&map)
            .map_err(|e| format!("invalid safetensors: {e}"))?;
    }
    Ok(())
}

/// Download progress for hf-hub: [`StartupProgress`] in bytes, one per file.
struct ProgressReport {
    file: String,
    terminal: bool,
    inner: Option<StartupProgress>,
}

impl ProgressReport {
    fn new(file: &str, terminal: bool) -> Self {
        ProgressReport {
            file: file.into(),
            terminal,
            inner: None,
        }
    }
}

impl Progress for ProgressReport {
    fn init(&mut self, size: usize, _filename: &str) {
        // hf-hub calls this at the start of a file and again for each (resumed) request.
        if self
            .inner
            .as_ref()
            .is_some_and(|p| p.total() == size as u64)
        {
            return;
        }
        self.inner = Some(StartupProgress::with_terminal(
            format!("downloading {}", self.file),
            size as u64,
            Unit::Bytes,
            self.terminal,
        ));
    }

    fn update(&mut self, size: usize) {
        if let Some(p) = &mut self.inner {
            p.inc(size as u64);
        }
    }

    fn finish(&mut self) {
        if let Some(p) = self.inner.take() {
            p.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids() {
        assert!(is_hub_id("meta-llama/Llama-3.2-1B-Instruct"));
        assert!(is_hub_id("Qwen/Qwen3-0.6B"));
        assert!(is_hub_id("org_1/name.v2"));
        for not in [
            "",
            "name",
            "a/b/c",
            "/abs/path",
            "./rel",
            "../x/y",
            "a/..",
            "a/ b",
            "a/",
            "/b",
            ".x/y",
            "a/-b",
        ] {
            assert!(!is_hub_id(not), "{not:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        let local = dir.path().join("org");
        std::fs::create_dir_all(local.join("name")).unwrap();
        let spec = local.join("name");
        assert!(
            !is_hub_id(spec.to_str().unwrap()),
            "an existing path is local"
        );
    }

    #[test]
    fn shard_lists_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(INDEX);
        std::fs::write(&p, r#"{"weight_map": {"a": "m-2.safetensors", "b": "m-1.safetensors", "c": "m-1.safetensors"}}"#).unwrap();
        assert_eq!(shards(&p).unwrap(), ["m-1.safetensors", "m-2.safetensors"]);
        std::fs::write(
            &p,
            r#"{"weight_map": {"a": "../../etc/passwd.safetensors"}}"#,
        )
        .unwrap();
        assert!(shards(&p)
            .unwrap_err()
            .contains("not a .safetensors file beside"));
        std::fs::write(&p, r#"{"metadata": {}}"#).unwrap();
        assert!(shards(&p).unwrap_err().contains("weight_map"));
    }
}
