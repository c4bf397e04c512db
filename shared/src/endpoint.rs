//! `ipc://` and `tcp://` addresses and the private socket directory.
//!
//! An [`Endpoint`] is parsed strictly (absolute ipc paths, IP-literal tcp hosts) so that a
//! typo is an error at start-up rather than a connect that retries for 30 s.
//! [`private_socket_dir`] gives the mode-0700 directory the ipc sockets live in by default,
//! and [`prepare_bind`] clears a stale socket file left by a crashed engine (zmq.rs's ipc
//! bind fails on one).

use std::fmt;
use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{bail, Context};

/// Longest path a Unix domain socket address can hold on Linux (`sun_path` is 108 bytes,
/// one of which is the terminating NUL).
pub const MAX_IPC_PATH_LEN: usize = 107;

/// Where a ZeroMQ socket binds or connects.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// A Unix domain socket at an absolute path (`ipc:///run/user/1000/harrier/engine.sock`).
    Ipc(PathBuf),
    /// A TCP address (`tcp://127.0.0.1:5555`, `tcp://[::1]:5555`). Port 0 asks the OS for one
    /// when binding.
    Tcp(SocketAddr),
}

/// Why a string is not a valid [`Endpoint`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid endpoint {input:?}: {reason}")]
pub struct EndpointParseError {
    /// The string that was parsed.
    pub input: String,
    /// What is wrong with it.
    pub reason: String,
}

impl Endpoint {
    /// The address string zmq.rs understands (same as `Display`).
    pub fn to_zmq(&self) -> String {
        self.to_string()
    }

    /// The socket file's path for `ipc://` endpoints.
    pub fn ipc_path(&self) -> Option<&Path> {
        match self {
            Endpoint::Ipc(path) => Some(path),
            Endpoint::Tcp(_) => None,
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Ipc(path) => write!(f, "ipc://{}", path.display()),
            // SocketAddr's Display brackets IPv6 hosts: tcp://[::1]:5555.
            Endpoint::Tcp(addr) => write!(f, "tcp://{addr}"),
        }
    }
}

impl FromStr for Endpoint {
    type Err = EndpointParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason: String| EndpointParseError {
            input: s.to_owned(),
            reason,
        };
        if let Some(path) = s.strip_prefix("ipc://") {
            if path.is_empty() {
                return Err(err(
                    "the ipc path is empty (expected ipc:///abs/path)".into()
                ));
            }
            if !path.starts_with('/') {
                return Err(err(format!(
                    "the ipc path {path:?} is not absolute (expected ipc:///abs/path)"
                )));
            }
            if path.len() > MAX_IPC_PATH_LEN {
                return Err(err(format!(
                    "the ipc path is {} bytes long; a Unix socket path holds at most {MAX_IPC_PATH_LEN}",
                    path.len()
                )));
            }
            Ok(Endpoint::Ipc(PathBuf::from(path)))
        } else if let Some(addr) = s.strip_prefix("tcp://") {
            if let Ok(addr) = addr.parse::<SocketAddr>() {
                return Ok(Endpoint::Tcp(addr));
            }
            let Some((host, port)) = addr.rsplit_once(':') else {
                return Err(err("expected tcp://host:port".into()));
            };
            let port: u16 = port
                .parse()
                .map_err(|_| err(format!("the port {port:?} is not a number in 0..=65535")))?;
            if host.eq_ignore_ascii_case("localhost") {
                return Ok(Endpoint::Tcp(SocketAddr::new(
                    IpAddr::V4(Ipv4Addr::LOCALHOST),
                    port,
                )));
            }
            if host.contains(':') && !host.starts_with('[') {
                return Err(err(
                    "an IPv6 host must be bracketed: tcp://[::1]:port".into()
                ));
            }
            Err(err(format!(
                "the host {host:?} is neither an IP address nor `localhost` (host names are not resolved)"
            )))
        } else {
            Err(err("expected an ipc:// or tcp:// address".into()))
        }
    }
}

/// The effective user id of this process.
fn current_uid() -> u32 {
    // SAFETY: geteuid takes no arguments, cannot fail and touches no memory of ours.
    unsafe { libc::geteuid() }
}

/// Creates `dir` with mode 0700 if it is missing (its parents with default permissions).
/// Returns whether it was created.
fn create_private_dir(dir: &Path) -> anyhow::Result<bool> {
    if let Some(parent) = dir.parent() {
        if !parent.as_os_str().is_empty() {
            fs::create_dir_all(parent)
                .with_context(|| format!("cannot create directory {}", parent.display()))?;
        }
    }
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e).with_context(|| format!("cannot create directory {}", dir.display())),
    }
}

/// Checks that `dir` is a real directory owned by us and sets its mode to 0700 if it has any
/// other bits (group/other access, or a umask that removed owner bits).
fn ensure_private(dir: &Path) -> anyhow::Result<()> {
    // symlink_metadata: a symlink planted in a shared /tmp must not redirect us.
    let meta = fs::symlink_metadata(dir)
        .with_context(|| format!("cannot inspect socket directory {}", dir.display()))?;
    if meta.file_type().is_symlink() {
        bail!(
            "socket directory {} is a symbolic link; refusing to use it",
            dir.display()
        );
    }
    if !meta.is_dir() {
        bail!(
            "socket directory {} exists and is not a directory",
            dir.display()
        );
    }
    let uid = current_uid();
    if meta.uid() != uid {
        bail!(
            "socket directory {} is owned by uid {}, not by this user (uid {uid}); refusing to use it",
            dir.display(),
            meta.uid()
        );
    }
    let mode = meta.mode() & 0o777;
    if mode != 0o700 {
        tracing::warn!(
            dir = %dir.display(),
            mode = format_args!("{mode:o}"),
            "socket directory was not private; setting mode 0700"
        );
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .with_context(|| format!("cannot set mode 0700 on {}", dir.display()))?;
    }
    Ok(())
}

/// The directory ipc sockets live in: created if needed with mode 0700, owned by this user.
///
/// `base` overrides the default, which is `$XDG_RUNTIME_DIR/harrier` when that variable holds
/// an absolute path, else `<temp dir>/harrier-<uid>`. An existing directory owned by another
/// user (or a symlink, or not a directory) is refused; one we own with group/other
/// permission bits is fixed to 0700.
pub fn private_socket_dir(base: Option<&Path>) -> anyhow::Result<PathBuf> {
    let dir = match base {
        Some(base) => base.to_path_buf(),
        None => match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
            Some(xdg) if xdg.is_absolute() => xdg.join("harrier"),
            _ => std::env::temp_dir().join(format!("harrier-{}", current_uid())),
        },
    };
    create_private_dir(&dir)?;
    ensure_private(&dir)?;
    Ok(dir)
}

/// The engine core's default endpoint in a socket directory: `ipc://<dir>/engine.sock`.
pub fn default_engine_endpoint(dir: &Path) -> Endpoint {
    Endpoint::Ipc(dir.join("engine.sock"))
}

/// Gets an endpoint ready to be bound.
///
/// For `ipc://`: creates a missing parent directory with mode 0700 (an existing one is left
/// as it is, with a warning if group or others may enter it), and removes a stale socket
/// file (one nobody listens on; zmq.rs's bind would fail on it). A socket someone still
/// listens on, or a path that is not a socket, is an error rather than deleted.
/// For `tcp://` there is nothing to do.
pub fn prepare_bind(ep: &Endpoint) -> anyhow::Result<()> {
    let Endpoint::Ipc(path) = ep else {
        return Ok(());
    };
    if let Some(parent) = path.parent() {
        if create_private_dir(parent)? {
            ensure_private(parent)?;
        } else {
            let meta = fs::metadata(parent)
                .with_context(|| format!("cannot inspect {}", parent.display()))?;
            if !meta.is_dir() {
                bail!("cannot bind {ep}: {} is not a directory", parent.display());
            }
            if meta.mode() & 0o077 != 0 {
                tracing::warn!(
                    dir = %parent.display(),
                    mode = format_args!("{:o}", meta.mode() & 0o777),
                    "ipc socket directory is accessible to other users"
                );
            }
        }
    }
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("cannot inspect {}", path.display())),
    };
    if !meta.file_type().is_socket() {
        bail!(
            "cannot bind {ep}: {} exists and is not a socket; not removing it",
            path.display()
        );
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => bail!("cannot bind {ep}: another process is listening on it"),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            tracing::info!(path = %path.display(), "removing stale ipc socket file");
            match fs::remove_file(path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e).with_context(|| format!("cannot remove stale {}", path.display())),
            }
        }
        Err(e) => {
            Err(e).with_context(|| format!("cannot probe existing socket {}", path.display()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Endpoint, EndpointParseError> {
        s.parse()
    }

    #[test]
    fn parses_ipc() {
        assert_eq!(
            parse("ipc:///tmp/x/engine.sock").unwrap(),
            Endpoint::Ipc("/tmp/x/engine.sock".into())
        );
    }

    #[test]
    fn parses_tcp() {
        assert_eq!(
            parse("tcp://127.0.0.1:5555").unwrap(),
            Endpoint::Tcp("127.0.0.1:5555".parse().unwrap())
        );
        assert_eq!(
            parse("tcp://0.0.0.0:0").unwrap(),
            Endpoint::Tcp("0.0.0.0:0".parse().unwrap())
        );
        assert_eq!(
            parse("tcp://[::1]:80").unwrap(),
            Endpoint::Tcp("[::1]:80".parse().unwrap())
        );
        assert_eq!(
            parse("tcp://localhost:9").unwrap(),
            Endpoint::Tcp("127.0.0.1:9".parse().unwrap())
        );
        assert_eq!(
            parse("tcp://LocalHost:9").unwrap(),
            Endpoint::Tcp("127.0.0.1:9".parse().unwrap())
        );
    }

    #[test]
    fn rejects_bad_addresses() {
        for (bad, needle) in [
            ("", "ipc:// or tcp://"),
            ("inproc://x", "ipc:// or tcp://"),
            ("ipc://", "empty"),
            ("ipc://relative/path", "not absolute"),
            ("tcp://127.0.0.1", "host:port"),
            ("tcp://127.0.0.1:", "port"),
            ("tcp://127.0.0.1:65536", "port"),
            ("tcp://127.0.0.1:http", "port"),
            ("tcp://example.com:80", "neither an IP"),
            ("tcp://*:80", "neither an IP"),
            ("tcp://::1:80", "bracketed"),
            ("TCP://127.0.0.1:80", "ipc:// or tcp://"),
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.to_string().contains(needle), "{bad:?}: {e}");
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
        let long = format!("ipc:///{}", "a".repeat(MAX_IPC_PATH_LEN));
        assert!(parse(&long).unwrap_err().to_string().contains("at most"));
    }

    #[test]
    fn display_round_trips_and_matches_zmq() {
        for s in [
            "ipc:///tmp/a b/engine.sock",
            "tcp://127.0.0.1:5555",
            "tcp://[::1]:7",
        ] {
            let ep = parse(s).unwrap();
            assert_eq!(ep.to_string(), s);
            assert_eq!(ep.to_zmq(), s);
            assert_eq!(parse(&ep.to_zmq()).unwrap(), ep);
            // zmq.rs must accept what we give it.
            let z: zeromq::Endpoint = ep.to_zmq().parse().unwrap();
            assert_eq!(z.to_string(), s);
        }
    }

    #[test]
    fn default_endpoint_is_engine_sock() {
        assert_eq!(
            default_engine_endpoint(Path::new("/run/h")).to_zmq(),
            "ipc:///run/h/engine.sock"
        );
    }

    fn mode(p: &Path) -> u32 {
        fs::metadata(p).unwrap().mode() & 0o777
    }

    #[test]
    fn private_dir_is_created_0700() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b/harrier");
        assert_eq!(private_socket_dir(Some(&dir)).unwrap(), dir);
        assert_eq!(mode(&dir), 0o700);
        // Idempotent.
        assert_eq!(private_socket_dir(Some(&dir)).unwrap(), dir);
    }

    #[test]
    fn private_dir_default_location() {
        let dir = private_socket_dir(None).unwrap();
        assert!(dir
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("harrier"));
        assert_eq!(mode(&dir), 0o700);
    }

    #[test]
    fn private_dir_perms_are_fixed() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("h");
        fs::create_dir(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
        private_socket_dir(Some(&dir)).unwrap();
        assert_eq!(mode(&dir), 0o700);
    }

    #[test]
    fn private_dir_refuses_files_and_symlinks() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("file");
        fs::write(&file, b"x").unwrap();
        assert!(private_socket_dir(Some(&file))
            .unwrap_err()
            .to_string()
            .contains("not a directory"));
        let real = tmp.path().join("real");
        fs::create_dir(&real).unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(private_socket_dir(Some(&link))
            .unwrap_err()
            .to_string()
            .contains("symbolic link"));
    }

    #[test]
    fn private_dir_refuses_other_owner() {
        if current_uid() != 0 {
            eprintln!("skipped: needs root to chown");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("theirs");
        fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
        std::os::unix::fs::chown(&dir, Some(12345), None).unwrap();
        let e = private_socket_dir(Some(&dir)).unwrap_err().to_string();
        assert!(e.contains("owned by uid 12345"), "{e}");
    }

    #[test]
    fn prepare_bind_creates_parent_and_removes_stale_socket() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("sub/engine.sock");
        let ep = Endpoint::Ipc(path.clone());
        prepare_bind(&ep).unwrap();
        assert_eq!(mode(path.parent().unwrap()), 0o700);
        // A socket file whose listener is gone is stale.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        prepare_bind(&ep).unwrap();
        assert!(!path.exists());
    }

    #[test]
    fn prepare_bind_refuses_live_socket_and_plain_file() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("engine.sock");
        let ep = Endpoint::Ipc(path.clone());
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        assert!(prepare_bind(&ep)
            .unwrap_err()
            .to_string()
            .contains("another process"));
        drop(listener);
        fs::remove_file(&path).unwrap();
        fs::write(&path, b"data").unwrap();
        assert!(prepare_bind(&ep)
            .unwrap_err()
            .to_string()
            .contains("not a socket"));
        assert!(path.exists());
    }

    #[test]
    fn prepare_bind_tcp_is_a_no_op() {
        prepare_bind(&parse("tcp://127.0.0.1:0").unwrap()).unwrap();
    }
}
