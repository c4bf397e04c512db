//! `harrier serve`: one engine core and N front ends as child processes of this executable.
//!
//! ```text
//!   harrier serve ──exec──► harrier engine-core --endpoint ipc://<private dir>/engine-<pid>.sock
//!                 ──exec──► harrier frontend --reuse-port --port P   (× N, one port)
//! ```
//!
//! - Children are started with exec (never a bare fork) from the launcher's only thread, in
//!   their own process group, with PR_SET_PDEATHSIG so they get SIGTERM if the launcher dies.
//! - Ready when every front end printed its ready line (it listens and the engine answered)
//!   and `/health` on the port answers 200; then the URL is printed.
//! - SIGINT/SIGTERM: the front ends drain (SIGTERM: stop accepting, finish in-flight requests
//!   up to --drain-timeout), then the engine gets SIGTERM; the process group is killed at the
//!   end so nothing is left behind. Exit 0.
//! - Any child exiting on its own (the engine dying above all) stops the rest and exits
//!   non-zero, so a supervisor (systemd `Restart=on-failure`, compose) restarts the set.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use harrier_engine::cli::EngineCoreArgs;
use harrier_shared::endpoint::{private_socket_dir, Endpoint};
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use crate::cli::{HttpArgs, READY_MARKER};
use crate::http_client::{wait_healthy, BaseUrl};

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// The model: a Hugging Face model directory or a Hub model id (`ORG/NAME`), as `--model`.
    #[arg(value_name = "MODEL", conflicts_with = "model")]
    pub model_arg: Option<PathBuf>,
    /// Number of front-end processes (all serve the same port through SO_REUSEPORT).
    #[arg(long, default_value_t = 1)]
    pub api_server_count: u32,
    /// Engine cores (data parallelism): each has its own scheduler and KV cache (and GPU:
    /// engine core i sees GPU i); every front end spreads requests over them. An engine
    /// core that dies fails only its own requests and is restarted.
    #[arg(long, default_value_t = 1)]
    pub data_parallel_size: u32,
    #[command(flatten)]
    pub http: HttpArgs,
    /// Seconds to wait for the engine and front ends to become ready.
    #[arg(long, default_value_t = 600.0)]
    pub startup_timeout: f64,
    #[command(flatten)]
    pub engine: EngineCoreArgs,
}

/// Runs the whole set until a signal (exit 0) or a child's death (error).
pub fn run_serve(args: ServeArgs, raw_args: &[String]) -> anyhow::Result<()> {
    args.http.validate()?;
    if args.api_server_count == 0 {
        bail!("--api-server-count must be at least 1");
    }
    if args.data_parallel_size == 0 {
        bail!("--data-parallel-size must be at least 1");
    }
    if args.data_parallel_size > 1 && args.engine.endpoint.is_some() {
        bail!("--endpoint names one engine core; with --data-parallel-size the launcher places the engine cores' sockets itself");
    }
    // Resolved once here (a Hub model is fetched now, with its progress on this terminal);
    // the children get the local directory, and the engine the Hub id as its served name.
    let resolved = harrier_engine::cli::resolve_model(
        args.model_arg.as_deref().or(args.engine.model.as_deref()),
        args.engine.revision.as_deref(),
    )?;
    let model = resolved.dir;
    let served_name = match (&args.engine.served_model_name, resolved.hub_id) {
        (None, Some(id)) => Some(id),
        _ => None,
    };
    let socket_dir = private_socket_dir(args.engine.socket_dir.as_deref())?;
    let endpoints = match &args.engine.endpoint {
        Some(e) => vec![e.clone()],
        None if args.data_parallel_size == 1 => vec![Endpoint::Ipc(
            socket_dir.join(format!("engine-{}.sock", std::process::id())),
        )],
        None => (0..args.data_parallel_size)
            .map(|i| {
                Endpoint::Ipc(socket_dir.join(format!("engine-{}-{i}.sock", std::process::id())))
            })
            .collect(),
    };
    // The front ends' shared metrics directory (removed when the launcher exits).
    let metrics_dir = tempfile::Builder::new()
        .prefix(&format!("metrics-{}-", std::process::id()))
        .tempdir_in(&socket_dir)
        .with_context(|| format!("creating a metrics directory in {}", socket_dir.display()))?;
    // The launcher does little: one thread, so PDEATHSIG (tied to the spawning thread) holds.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(
        Launcher {
            args,
            model,
            served_name,
            endpoints,
            metrics_dir,
            raw_args: raw_args.to_vec(),
        }
        .run(),
    )
}

struct Launcher {
    args: ServeArgs,
    model: PathBuf,
    /// `--served-model-name` for the engine when the user gave none (a Hub id).
    served_name: Option<String>,
    /// One per engine core.
    endpoints: Vec<Endpoint>,
    metrics_dir: tempfile::TempDir,
    raw_args: Vec<String>,
}

struct Proc {
    name: String,
    child: Child,
}

enum Outcome {
    Signal,
    /// The name, its index in the process list, and its status.
    ChildExited(String, usize, std::process::ExitStatus),
}

impl Launcher {
    async fn run(self) -> anyhow::Result<()> {
        let exe = std::env::current_exe().context("locating the harrier executable")?;
        // Port 0: pick one free port for every front end, and hold it (bound, not listening,
        // so it gets no connections) until they are up.
        let mut port = self.args.http.port;
        let _reservation = if port == 0 {
            let s = reserve_port(SocketAddr::new(self.args.http.host, 0))?;
            port = s
                .local_addr()?
                .as_socket()
                .context("reserved socket has no address")?
                .port();
            Some(s)
        } else {
            None
        };
        let mut signals = Signals::new()?;
        let n_engines = self.endpoints.len();
        let first = self.spawn_engine(&exe, 0, None)?;
        let pgid = first.child.id().context("engine pid")? as i32;
        let mut engines = vec![first];
        for i in 1..n_engines {
            engines.push(self.spawn_engine(&exe, i, Some(pgid))?);
        }
        let engine_endpoints = self
            .endpoints
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let (ready_tx, mut ready_rx) = mpsc::unbounded_channel();
        let mut frontends = Vec::new();
        for i in 0..self.args.api_server_count {
            let mut cmd = Command::new(&exe);
            cmd.arg("frontend")
                .arg("--model")
                .arg(&self.model)
                .arg("--engine-endpoint")
                .arg(&engine_endpoints);
            cmd.arg("--host")
                .arg(self.args.http.host.to_string())
                .arg("--port")
                .arg(port.to_string());
            cmd.arg("--reuse-port")
                .arg("--ready-line")
                .arg("--frontend-index")
                .arg(i.to_string())
                .arg("--metrics-dir")
                .arg(self.metrics_dir.path());
            cmd.arg("--drain-timeout")
                .arg(self.args.http.drain_timeout.to_string());
            cmd.arg("--max-body-bytes")
                .arg(self.args.http.max_body_bytes.to_string())
                .arg("--max-n")
                .arg(self.args.http.max_n.to_string());
            if let Some(t) = &self.args.http.tokenizer {
                cmd.arg("--tokenizer").arg(t);
            }
            if let Some(t) = &self.args.http.chat_template {
                cmd.arg("--chat-template").arg(t);
            }
            if let Some(n) = self.args.http.tokenizer_threads {
                cmd.arg("--tokenizer-threads").arg(n.to_string());
            }
            if let Some(p) = self.args.http.tool_call_parser {
                use clap::ValueEnum;
                let name = p.to_possible_value().expect("named").get_name().to_owned();
                cmd.arg("--tool-call-parser").arg(name);
            }
            if self.args.http.enable_auto_tool_choice {
                cmd.arg("--enable-auto-tool-choice");
            }
            if let Some(key) = &self.args.http.api_key {
                cmd.env("HARRIER_API_KEY", key);
            }
            let mut p = spawn(cmd, &format!("frontend-{i}"), Some(pgid), true)?;
            forward_stdout(&mut p, ready_tx.clone());
            frontends.push(p);
        }
        drop(ready_tx);
        let mut procs: Vec<Proc> = engines.into_iter().chain(frontends).collect();

        // Start-up: every front end ready, then /health 200 on the shared port.
        let host = if self.args.http.host.is_unspecified() {
            "127.0.0.1".parse().expect("ip")
        } else {
            self.args.http.host
        };
        let base = BaseUrl::from_addr(SocketAddr::new(host, port));
        let deadline =
            tokio::time::Instant::now() + Duration::from_secs_f64(self.args.startup_timeout);
        let mut ready = 0;
        let startup = async {
            while ready < self.args.api_server_count {
                match ready_rx.recv().await {
                    Some(()) => ready += 1,
                    None => return false,
                }
            }
            wait_healthy(&base, Duration::from_secs(30)).await
        };
        let outcome = tokio::select! {
            ok = startup => if ok { None } else { Some(Err(anyhow::anyhow!("the front ends did not become ready"))) },
            _ = tokio::time::sleep_until(deadline) => Some(Err(anyhow::anyhow!("not ready after {} s", self.args.startup_timeout))),
            o = wait_any(&mut procs) => Some(Ok(o)),
            _ = signals.recv() => Some(Ok(Outcome::Signal)),
        };
        let outcome = match outcome {
            None => {
                let display_host = if self.args.http.host.is_unspecified() {
                    self.args.http.host.to_string()
                } else {
                    host.to_string()
                };
                let shown = SocketAddr::new(display_host.parse().unwrap_or(host), port);
                let cores = if n_engines > 1 {
                    format!(", {n_engines} engine cores")
                } else {
                    String::new()
                };
                println!("Harrier is serving {} at http://{shown}/v1 ({} front end(s){cores}, engine pid {pgid}). Ctrl-C stops it.", self.model_name(), self.args.api_server_count);
                loop {
                    let o = tokio::select! {
                        o = wait_any(&mut procs) => o,
                        _ = signals.recv() => break Ok(Outcome::Signal),
                    };
                    // With several engine cores, one that dies is restarted; the others
                    // keep serving and the front ends reconnect to it.
                    match o {
                        Outcome::ChildExited(name, i, status) if n_engines > 1 && i < n_engines => {
                            tracing::error!(%name, %status, "an engine core exited; its requests failed; restarting it");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            match self.spawn_engine(&exe, i, Some(pgid)) {
                                Ok(p) => procs[i] = p,
                                Err(e) => break Err(e),
                            }
                        }
                        o => break Ok(o),
                    }
                }
            }
            Some(o) => o,
        };
        let result = match outcome {
            Ok(Outcome::Signal) => {
                tracing::info!(
                    "signal received: draining the front ends, then stopping the engine core"
                );
                Ok(())
            }
            Ok(Outcome::ChildExited(name, _, status)) => Err(anyhow::anyhow!(
                "{name} exited unexpectedly ({status}); stopping"
            )),
            Err(e) => Err(e),
        };
        if let Err(e) = &result {
            tracing::error!("{e:#}");
        }
        self.shutdown(&mut procs, pgid, &mut signals).await;
        result
    }

    /// Engine core `i`, in process group `pgid` (a new one for the first). With several
    /// engine cores on CUDA, engine core `i` sees only GPU `i` (of CUDA_VISIBLE_DEVICES when
    /// set).
    fn spawn_engine(
        &self,
        exe: &std::path::Path,
        i: usize,
        pgid: Option<i32>,
    ) -> anyhow::Result<Proc> {
        let mut cmd = Command::new(exe);
        cmd.arg("engine-core")
            .arg("--model")
            .arg(&self.model)
            .arg("--endpoint")
            .arg(self.endpoints[i].to_string());
        if let Some(name) = &self.served_name {
            cmd.arg("--served-model-name").arg(name);
        }
        cmd.args(engine_passthrough(&self.raw_args));
        if self.endpoints.len() > 1 && self.args.engine.device != harrier_engine::cli::Device::Cpu {
            let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
            let gpu = visible
                .as_deref()
                .and_then(|v| v.split(',').nth(i).map(str::to_owned))
                .unwrap_or_else(|| i.to_string());
            cmd.env("CUDA_VISIBLE_DEVICES", gpu);
        }
        let name = if self.endpoints.len() > 1 {
            format!("engine-core-{i}")
        } else {
            "engine-core".to_string()
        };
        let p = spawn(cmd, &name, pgid, false)?;
        tracing::info!(pid = p.child.id(), endpoint = %self.endpoints[i], model = %self.model.display(), "started the engine core");
        Ok(p)
    }

    fn model_name(&self) -> String {
        self.args
            .engine
            .served_model_name
            .clone()
            .unwrap_or_else(|| {
                self.model
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default()
            })
    }

    /// Front ends first (they drain), then the engine; a second signal kills at once.
    async fn shutdown(&self, procs: &mut [Proc], pgid: i32, signals: &mut Signals) {
        let drain =
            Duration::from_secs_f64(self.args.http.drain_timeout.max(0.0)) + Duration::from_secs(5);
        let (engines, frontends) = procs.split_at_mut(self.endpoints.len());
        for p in frontends.iter_mut() {
            terminate(p);
        }
        let fronts_done = async {
            for p in frontends.iter_mut() {
                let _ = p.child.wait().await;
            }
        };
        tokio::select! {
            _ = fronts_done => {},
            _ = tokio::time::sleep(drain) => tracing::warn!("front ends did not stop in time; killing them"),
            _ = signals.recv() => tracing::warn!("second signal: stopping at once"),
        }
        for p in frontends.iter_mut() {
            let _ = p.child.start_kill();
        }
        for e in engines.iter() {
            terminate(e);
        }
        let engines_done = async {
            for e in engines.iter_mut() {
                let _ = e.child.wait().await;
            }
        };
        tokio::select! {
            _ = engines_done => {},
            _ = tokio::time::sleep(Duration::from_secs(15)) => tracing::warn!("the engine core did not stop in time; killing it"),
            _ = signals.recv() => tracing::warn!("second signal: stopping at once"),
        }
        // Whatever is left in the group (children of children included).
        // SAFETY: killpg takes plain integers; a group that no longer exists gives ESRCH.
        unsafe {
            libc::killpg(pgid, libc::SIGKILL);
        }
        for p in procs.iter_mut() {
            let _ = p.child.wait().await;
        }
        for e in &self.endpoints {
            if let Endpoint::Ipc(path) = e {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

fn terminate(p: &Proc) {
    if let Some(pid) = p.child.id() {
        // SAFETY: kill takes plain integers; the child has not been reaped (id() is Some).
        unsafe {
            libc::kill(pid as i32, libc::SIGTERM);
        }
    }
}

/// Starts `cmd` in process group `pgid` (a new one when `None`), with PDEATHSIG.
fn spawn(
    mut cmd: Command,
    name: &str,
    pgid: Option<i32>,
    pipe_stdout: bool,
) -> anyhow::Result<Proc> {
    cmd.process_group(pgid.unwrap_or(0))
        .stdin(Stdio::null())
        .kill_on_drop(true);
    if pipe_stdout {
        cmd.stdout(Stdio::piped());
    }
    // SAFETY: between fork and exec only async-signal-safe calls: prctl and getppid are
    // plain syscalls and touch no memory of ours.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher may have died between fork and prctl.
            if libc::getppid() == 1 {
                return Err(std::io::Error::other("the launcher exited"));
            }
            Ok(())
        });
    }
    let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
    Ok(Proc {
        name: name.to_owned(),
        child,
    })
}

/// Echoes a front end's stdout and reports its ready line.
fn forward_stdout(p: &mut Proc, ready: mpsc::UnboundedSender<()>) {
    let Some(out) = p.child.stdout.take() else {
        return;
    };
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(out).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if line.starts_with(READY_MARKER) {
                let _ = ready.send(());
            } else {
                println!("{line}");
            }
        }
    });
}

/// The first child to exit.
async fn wait_any(procs: &mut [Proc]) -> Outcome {
    let waits = procs.iter_mut().map(|p| {
        Box::pin(async move {
            let status = p.child.wait().await;
            (p.name.clone(), status)
        })
    });
    let ((name, status), i, _) = futures::future::select_all(waits).await;
    match status {
        Ok(s) => Outcome::ChildExited(name, i, s),
        Err(e) => {
            tracing::error!(%name, error = %e, "cannot wait for a child");
            Outcome::ChildExited(name, i, std::process::ExitStatus::default())
        }
    }
}

fn reserve_port(addr: SocketAddr) -> anyhow::Result<socket2::Socket> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    s.bind(&addr.into())?;
    Ok(s)
}

/// The engine options among `harrier serve`'s raw arguments (model and endpoint are set by
/// the launcher; serve-only options are dropped).
pub fn engine_passthrough(raw: &[String]) -> Vec<String> {
    let engine = EngineCoreArgs::augment_args(clap::Command::new("engine-core"));
    let serve = ServeArgs::augment_args(clap::Command::new("serve"));
    // The launcher resolves the model (and its revision) and names the endpoint itself.
    let skip = ["model", "revision", "endpoint"];
    let mut out = Vec::new();
    let mut it = raw.iter().peekable();
    while let Some(arg) = it.next() {
        let Some(long) = arg.strip_prefix("--") else {
            continue;
        };
        let (name, inline_value) = match long.split_once('=') {
            Some((n, _)) => (n, true),
            None => (long, false),
        };
        let takes_value = |cmd: &clap::Command| {
            cmd.get_arguments()
                .find(|a| a.get_long() == Some(name))
                .map(|a| a.get_action().takes_values())
        };
        let forward = takes_value(&engine).is_some() && !skip.contains(&name);
        let needs_value = !inline_value
            && takes_value(&serve)
                .or(takes_value(&engine))
                .unwrap_or(false);
        if forward {
            out.push(arg.clone());
        }
        if needs_value {
            if let Some(v) = it.next() {
                if forward {
                    out.push(v.clone());
                }
            }
        }
    }
    out
}

/// SIGINT and SIGTERM as one stream.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
        })
    }

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.int.recv() => {},
            _ = self.term.recv() => {},
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn engine_options_pass_through() {
        let raw = s(&[
            "--model",
            "/m",
            "--api-server-count",
            "2",
            "--port=9000",
            "--max-num-seqs",
            "8",
            "--sync",
            "--host",
            "0.0.0.0",
            "--block-size=32",
            "--api-key",
            "k",
            "--endpoint",
            "ipc:///x",
        ]);
        assert_eq!(
            engine_passthrough(&raw),
            s(&["--max-num-seqs", "8", "--sync", "--block-size=32"])
        );
    }
}
