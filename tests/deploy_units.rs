//! The systemd units in `deploy/systemd/`, run the way systemd would run them, minus systemd.
//!
//! The command lines are taken from the unit files themselves (`ExecStart=`, `ExecStartPost=`)
//! and expanded as systemd expands them: specifiers (`%i`), `${VAR}` (one word) and `$VAR`
//! (split at whitespace) from `deploy/systemd/harrier.env` plus `$MAINPID`; the process gets
//! that environment. Only the host paths are mapped: `/usr/local/bin/harrier` to the built
//! binary, `/usr/local/lib/harrier/harrier-ready` to the repository's script, the
//! RuntimeDirectory `/run/harrier` to a fresh 0700 directory, the StateDirectory
//! `/var/lib/harrier` (HARRIER_HOME) to this machine's Harrier home (where the engine writes the
//! embedded default model on first start), and the port to a free one.
//!
//! Then: the engine core, its readiness wait, two front-end instances (`@0`, `@1`) on the same
//! port (SO_REUSEPORT) with theirs, streamed chat completions through the shared port, both
//! front ends seen answering, SIGTERM in systemd's stop order (front ends, then the engine)
//! and exit status 0 for each within the unit's TimeoutStopSec.
//!
//! The binary: `$HARRIER_BIN`, else `harrier` beside this test's target directory
//! (`cargo build -p harrier-frontend --bin harrier`; `cargo test --workspace` builds it).

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const ENGINE_UNIT: &str = "harrier-engine.service";
const FRONTEND_UNIT: &str = "harrier-frontend@.service";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn deploy_file(name: &str) -> PathBuf {
    repo_root().join("deploy/systemd").join(name)
}

// ---- unit files and environment files ---------------------------------------------------------

/// A unit file: (section, key, value) in file order; continuation lines joined.
struct Unit {
    entries: Vec<(String, String, String)>,
}

impl Unit {
    fn load(name: &str) -> Unit {
        let text = fs::read_to_string(deploy_file(name)).unwrap();
        let mut entries = Vec::new();
        let mut section = String::new();
        let mut pending = String::new();
        for raw in text.lines() {
            let line = raw.trim();
            if pending.is_empty()
                && (line.is_empty() || line.starts_with('#') || line.starts_with(';'))
            {
                continue;
            }
            if let Some(cont) = line.strip_suffix('\\') {
                pending.push_str(cont);
                pending.push(' ');
                continue;
            }
            let line = std::mem::take(&mut pending) + line;
            if line.starts_with('[') {
                section = line.trim_matches(|c| c == '[' || c == ']').to_string();
                continue;
            }
            let (k, v) = line
                .split_once('=')
                .unwrap_or_else(|| panic!("{name}: not key=value: {line}"));
            entries.push((section.clone(), k.trim().to_string(), v.trim().to_string()));
        }
        Unit { entries }
    }

    fn all(&self, section: &str, key: &str) -> Vec<&str> {
        self.entries
            .iter()
            .filter(|(s, k, _)| s == section && k == key)
            .map(|(_, _, v)| v.as_str())
            .collect()
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.entries
            .iter()
            .rev()
            .find(|(_, k, _)| k == key)
            .map(|(_, _, v)| v.as_str())
    }

    fn service(&self, key: &str) -> &str {
        let v = self.all("Service", key);
        assert!(!v.is_empty(), "no {key}= in [Service]");
        v[v.len() - 1]
    }
}

/// An EnvironmentFile: KEY=VALUE lines, `#`/`;` comments, optional surrounding quotes.
fn load_env_file(path: &Path) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for line in fs::read_to_string(path).unwrap().lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        let (k, v) = line
            .split_once('=')
            .unwrap_or_else(|| panic!("{}: not KEY=VALUE: {line}", path.display()));
        let v = v.trim();
        let v = if v.len() >= 2
            && ((v.starts_with('"') && v.ends_with('"'))
                || (v.starts_with('\'') && v.ends_with('\'')))
        {
            &v[1..v.len() - 1]
        } else {
            v
        };
        assert!(
            !v.is_empty(),
            "{}: {k} is empty (harrier rejects empty HARRIER_* values; comment it out)",
            path.display()
        );
        env.insert(k.trim().to_string(), v.to_string());
    }
    env
}

/// Splits a command line into words as systemd does: whitespace, "..." and '...' quotes,
/// backslash escapes.
fn split_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (_, '\\') => {
                cur.push(chars.next().expect("trailing backslash"));
                in_word = true;
            }
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            (None, c) => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    assert!(quote.is_none(), "unterminated quote in {line:?}");
    if in_word {
        words.push(cur);
    }
    words
}

/// `${NAME}` anywhere in a word (unset: empty) and `$$`; other `$` signs stay.
fn replace_braced(word: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = word;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(t) = tail.strip_prefix("$$") {
            out.push('$');
            rest = t;
        } else if let Some(t) = tail.strip_prefix("${") {
            let end = t
                .find('}')
                .unwrap_or_else(|| panic!("unterminated ${{ in {word:?}"));
            out.push_str(env.get(&t[..end]).map(String::as_str).unwrap_or(""));
            rest = &t[end + 1..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

/// An Exec*= line as systemd runs it: prefixes stripped (returned), specifiers, variables.
fn expand_exec(
    line: &str,
    instance: &str,
    env: &BTreeMap<String, String>,
) -> (String, Vec<String>) {
    let mut spec = String::new();
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            spec.push(c);
            continue;
        }
        match chars.next() {
            Some('i') | Some('I') => spec.push_str(instance),
            Some('%') => spec.push('%'),
            other => panic!("specifier %{other:?} in {line:?} is not emulated by this test"),
        }
    }
    let mut words = split_words(&spec);
    let first = words[0].clone();
    let prefix: String = first.chars().take_while(|c| "@-:+!".contains(*c)).collect();
    words[0] = first[prefix.len()..].to_string();
    let mut argv = Vec::new();
    for w in words {
        match w.strip_prefix('$') {
            // `$NAME` as a whole word: the value split at whitespace (unset: no words).
            Some(name) if !name.starts_with('{') && !name.starts_with('$') && !name.is_empty() => {
                assert!(
                    name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                    "unsupported word {w:?}"
                );
                if let Some(v) = env.get(name) {
                    argv.extend(v.split_whitespace().map(str::to_string));
                }
            }
            _ => argv.push(replace_braced(&w, env)),
        }
    }
    (prefix, argv)
}

/// Host paths of the units, mapped to this machine.
struct PathMap(Vec<(String, String)>);

impl PathMap {
    /// Replaces each occurrence of a mapped path in one left-to-right pass (so a replacement
    /// is never mapped again).
    fn apply(&self, s: &str) -> String {
        let mut out = String::new();
        let mut i = 0;
        'scan: while i < s.len() {
            for (from, to) in &self.0 {
                if s[i..].starts_with(from.as_str()) {
                    out.push_str(to);
                    i += from.len();
                    continue 'scan;
                }
            }
            let c = s[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
        out
    }
}

// ---- processes --------------------------------------------------------------------------------

/// A spawned unit process; killed (SIGKILL) if the test ends without stopping it.
struct Proc {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Proc {
    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    fn log_tail(&self) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(st.success(), "kill -{sig} {} failed", self.name);
    }

    /// Waits for the exit; None after `timeout`.
    fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn assert_running(&mut self) {
        if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
            panic!("{} exited early ({st}):\n{}", self.name, self.log_tail());
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
            eprintln!("--- {} (killed) log:\n{}", self.name, self.log_tail());
        }
    }
}

fn command(argv: &[String], env: &BTreeMap<String, String>, cwd: &Path) -> Command {
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .env_clear()
        .envs(env)
        .current_dir(cwd)
        .stdin(Stdio::null());
    cmd
}

fn spawn(
    name: &str,
    argv: &[String],
    env: &BTreeMap<String, String>,
    cwd: &Path,
    logs: &Path,
) -> Proc {
    let log = logs.join(format!("{name}.log"));
    let out = fs::File::create(&log).unwrap();
    let child = command(argv, env, cwd)
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {name} ({argv:?}): {e}"));
    eprintln!("started {name} (pid {}): {}", child.id(), argv.join(" "));
    Proc {
        name: name.to_string(),
        child: Some(child),
        log,
    }
}

/// Runs an ExecStartPost= line to completion (the unit is "started" when it exits 0).
fn run_post(
    name: &str,
    argv: &[String],
    env: &BTreeMap<String, String>,
    cwd: &Path,
    main: &mut Proc,
    timeout: Duration,
) {
    let started = Instant::now();
    let mut post = command(argv, env, cwd)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {name} ExecStartPost ({argv:?}): {e}"));
    loop {
        if let Some(st) = post.try_wait().unwrap() {
            let mut err = String::new();
            post.stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            assert!(
                st.success(),
                "{name}: ExecStartPost {argv:?} failed ({st}): {err}\n{}",
                main.log_tail()
            );
            eprintln!("{name} ready after {:.1}s", started.elapsed().as_secs_f64());
            return;
        }
        if started.elapsed() > timeout {
            let _ = post.kill();
            panic!(
                "{name}: ExecStartPost still waiting after {timeout:?}\n{}",
                main.log_tail()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// systemd's time spans as the units use them: `30s`, `15min`, `2min 30s`, a bare number.
fn parse_timespan(s: &str) -> Duration {
    let mut total = 0.0;
    for part in s.split_whitespace() {
        let split = part
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(part.len());
        let (n, unit) = part.split_at(split);
        let n: f64 = n.parse().unwrap_or_else(|_| panic!("bad time span {s:?}"));
        total += n * match unit {
            "" | "s" | "sec" => 1.0,
            "min" | "m" => 60.0,
            "h" => 3600.0,
            "ms" => 0.001,
            _ => panic!("bad time span unit in {s:?}"),
        };
    }
    Duration::from_secs_f64(total)
}

// ---- HTTP -------------------------------------------------------------------------------------

struct Response {
    status: u16,
    headers: String,
    body: String,
}

/// One HTTP/1.1 request on a new connection (`Connection: close`), the body de-chunked.
fn http(port: u16, method: &str, path: &str, body: Option<&str>) -> Response {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("no end of headers");
    let headers = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut rest = &raw[split + 4..];
    let status: u16 = headers.split(' ').nth(1).unwrap().parse().unwrap();
    let chunked = headers.lines().any(|l| {
        l.to_ascii_lowercase().starts_with("transfer-encoding:")
            && l.to_ascii_lowercase().contains("chunked")
    });
    let body = if chunked {
        let mut out = Vec::new();
        loop {
            let nl = rest
                .windows(2)
                .position(|w| w == b"\r\n")
                .expect("bad chunk header");
            let size_str = String::from_utf8_lossy(&rest[..nl]);
            let size =
                usize::from_str_radix(size_str.split(';').next().unwrap().trim(), 16).unwrap();
            rest = &rest[nl + 2..];
            if size == 0 {
                break;
            }
            out.extend_from_slice(&rest[..size]);
            rest = &rest[size + 2..];
        }
        out
    } else {
        rest.to_vec()
    };
    Response {
        status,
        headers,
        body: String::from_utf8(body).unwrap(),
    }
}

/// A streamed chat completion; returns the content it streamed.
fn stream_chat(port: u16, max_tokens: u32) -> String {
    let req = serde_json::json!({
        "model": "ignored-by-check",
        "messages": [{"role": "user", "content": "Say something about harriers."}],
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    // The served model name is whatever the engine reports: ask for it first.
    let models = http(port, "GET", "/v1/models", None);
    assert_eq!(models.status, 200, "{}", models.body);
    let models: serde_json::Value = serde_json::from_str(&models.body).unwrap();
    let mut req = req;
    req["model"] = models["data"][0]["id"].clone();
    let r = http(port, "POST", "/v1/chat/completions", Some(&req.to_string()));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.headers
            .to_ascii_lowercase()
            .contains("content-type: text/event-stream"),
        "not an SSE stream: {}",
        r.headers
    );
    let events: Vec<&str> = r
        .body
        .split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .collect();
    assert_eq!(
        events.last(),
        Some(&"[DONE]"),
        "stream did not end with [DONE]: {}",
        r.body
    );
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("bad chunk {e:?}: {err}")))
        .collect();
    let mut content = String::new();
    let mut finish = None;
    for c in &chunks {
        for ch in c["choices"].as_array().unwrap() {
            if let Some(t) = ch["delta"]["content"].as_str() {
                content.push_str(t);
            }
            if let Some(f) = ch["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    assert_eq!(finish.as_deref(), Some("length"), "{}", r.body);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], max_tokens, "usage: {usage}");
    assert!(chunks.len() >= 3, "expected several chunks: {}", r.body);
    content
}

/// The front-end index that answered a /metrics scrape (`harrier_frontend_info{frontend}`).
fn answering_frontend(port: u16) -> String {
    let r = http(port, "GET", "/metrics", None);
    assert_eq!(r.status, 200);
    let i = r
        .body
        .find("frontend=\"")
        .expect("no frontend label in /metrics")
        + 10;
    r.body[i..].split('"').next().unwrap().to_string()
}

// ---- the test ---------------------------------------------------------------------------------

fn harrier_bin() -> PathBuf {
    if let Some(b) = std::env::var_os("HARRIER_BIN") {
        return PathBuf::from(b);
    }
    // target/<profile>/deps/deploy_units-<hash> -> target/<profile>/harrier
    let exe = std::env::current_exe().unwrap();
    let bin = exe.parent().unwrap().parent().unwrap().join("harrier");
    assert!(
        bin.is_file(),
        "{} is missing: run `cargo build -p harrier-frontend --bin harrier` (or set HARRIER_BIN)",
        bin.display()
    );
    bin
}

fn harrier_home() -> PathBuf {
    match std::env::var_os("HARRIER_HOME").filter(|h| !h.is_empty()) {
        Some(h) => PathBuf::from(h),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/harrier"),
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// What the units must keep for the deployment to work (and for GPU access to survive
/// hardening); `systemd-analyze verify` (scripts/check_deploy.sh) checks the syntax.
#[test]
fn units_keep_their_contract() {
    let engine = Unit::load(ENGINE_UNIT);
    let fe = Unit::load(FRONTEND_UNIT);
    for u in [&engine, &fe] {
        assert_eq!(u.service("User"), "harrier");
        let files = u.all("Service", "EnvironmentFile");
        assert_eq!(files[0], "/etc/harrier/harrier.env");
        // Further files are optional overrides (`-`): the test runs without them.
        assert!(files[1..].iter().all(|f| f.starts_with('-')), "{files:?}");
        assert_eq!(u.service("Restart"), "on-failure");
        assert!(u.get("StartLimitBurst").is_some() && u.get("StartLimitIntervalSec").is_some());
        assert_eq!(u.service("NoNewPrivileges"), "yes");
        assert_eq!(u.service("ProtectSystem"), "strict");
        assert_eq!(u.service("PrivateTmp"), "yes");
        assert_eq!(u.service("KillSignal"), "SIGTERM");
        assert_eq!(u.all("Install", "WantedBy"), ["harrier.target"]);
    }
    assert_eq!(engine.service("RuntimeDirectory"), "harrier");
    assert_eq!(engine.service("RuntimeDirectoryMode"), "0700");
    // Only the engine owns /run/harrier: a front end owning it too would have it removed
    // whenever that front end stops.
    assert!(fe.all("Service", "RuntimeDirectory").is_empty());
    // Hardening that would hide /dev/nvidia* or /proc/driver/nvidia, or break the driver's JIT.
    for key in [
        "PrivateDevices",
        "DevicePolicy",
        "DeviceAllow",
        "ProtectClock",
        "ProcSubset",
        "MemoryDenyWriteExecute",
        "PrivateUsers",
    ] {
        assert!(
            engine.all("Service", key).is_empty(),
            "{ENGINE_UNIT} sets {key}=, which breaks CUDA"
        );
    }
    assert!(fe
        .all("Unit", "Requires")
        .contains(&"harrier-engine.service"));
    assert!(fe
        .all("Unit", "After")
        .iter()
        .any(|a| a.split_whitespace().any(|u| u == "harrier-engine.service")));
    // The drain must fit in the stop timeout.
    let env = load_env_file(&deploy_file("harrier.env"));
    let args = split_words(&env["HARRIER_FRONTEND_ARGS"]);
    let drain: f64 = args
        .iter()
        .position(|a| a == "--drain-timeout")
        .map(|i| args[i + 1].parse().unwrap())
        .unwrap_or(30.0);
    assert!(parse_timespan(fe.service("TimeoutStopSec")).as_secs_f64() > drain + 5.0);
    for pre in engine.all("Service", "ExecStartPre") {
        assert!(
            pre.starts_with('-'),
            "ExecStartPre {pre:?} must be allowed to fail (hosts without it)"
        );
    }
}

#[test]
fn unit_command_lines_serve_a_stream_through_two_frontends_on_one_port() {
    let engine_unit = Unit::load(ENGINE_UNIT);
    let fe_unit = Unit::load(FRONTEND_UNIT);
    let tmp = tempfile::tempdir().unwrap();
    let runtime_dir = tmp.path().join("runtime");
    fs::create_dir(&runtime_dir).unwrap();
    let mode = u32::from_str_radix(engine_unit.service("RuntimeDirectoryMode"), 8).unwrap();
    fs::set_permissions(&runtime_dir, fs::Permissions::from_mode(mode)).unwrap();
    let logs = tmp.path().join("logs");
    fs::create_dir(&logs).unwrap();
    let home = harrier_home();

    let paths = PathMap(vec![
        (
            "/usr/local/bin/harrier".into(),
            harrier_bin().display().to_string(),
        ),
        (
            "/usr/local/lib/harrier/harrier-ready".into(),
            deploy_file("harrier-ready").display().to_string(),
        ),
        (
            format!("/run/{}", engine_unit.service("RuntimeDirectory")),
            runtime_dir.display().to_string(),
        ),
        (
            format!("/var/lib/{}", engine_unit.service("StateDirectory")),
            home.display().to_string(),
        ),
    ]);

    // The environment systemd would give: the EnvironmentFile, Environment= lines, and the
    // basics of a service (PATH, HOME of the service user, the directories).
    let port = free_port();
    // Command lines are expanded with the file's values and then mapped once; the processes
    // get the mapped values.
    let file_env = load_env_file(&deploy_file("harrier.env"));
    let mut env: BTreeMap<String, String> = file_env
        .iter()
        .map(|(k, v)| (k.clone(), paths.apply(v)))
        .collect();
    env.insert("HARRIER_PORT".into(), port.to_string());
    env.insert(
        "PATH".into(),
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
    );
    env.insert("HOME".into(), home.display().to_string());
    env.insert(
        "RUNTIME_DIRECTORY".into(),
        runtime_dir.display().to_string(),
    );
    env.insert("STATE_DIRECTORY".into(), home.display().to_string());
    // CPU threads for the CPU backend: let it pick (the unit does not set them).
    assert_eq!(
        env["HARRIER_HOST"], "127.0.0.1",
        "the test talks to the front ends on loopback"
    );

    let exec = |unit: &Unit,
                key: &str,
                instance: &str,
                env: &BTreeMap<String, String>|
     -> Vec<Vec<String>> {
        // Expand with the unmapped values, then map the words once.
        let mut raw = file_env.clone();
        for (k, v) in env {
            if !file_env.contains_key(k) || k == "HARRIER_PORT" {
                raw.insert(k.clone(), v.clone());
            }
        }
        let mut lines = Vec::new();
        for line in unit.all("Service", key) {
            let (prefix, argv) = expand_exec(line, instance, &raw);
            assert!(
                prefix.is_empty(),
                "{key}={line}: prefix {prefix:?} not expected"
            );
            lines.push(argv.iter().map(|a| paths.apply(a)).collect());
        }
        lines
    };
    let cwd_of = |unit: &Unit| PathBuf::from(paths.apply(unit.service("WorkingDirectory")));
    let start_timeout = |unit: &Unit| parse_timespan(unit.service("TimeoutStartSec"));
    let stop_timeout = |unit: &Unit| parse_timespan(unit.service("TimeoutStopSec"));

    // Engine core: ExecStart, then ExecStartPost with $MAINPID.
    let engine_start = exec(&engine_unit, "ExecStart", "", &env);
    assert_eq!(engine_start.len(), 1);
    let mut engine = spawn(
        "engine",
        &engine_start[0],
        &env,
        &cwd_of(&engine_unit),
        &logs,
    );
    let mut env_post = env.clone();
    env_post.insert("MAINPID".into(), engine.pid().to_string());
    for post in exec(&engine_unit, "ExecStartPost", "", &env_post) {
        run_post(
            "engine",
            &post,
            &env_post,
            &cwd_of(&engine_unit),
            &mut engine,
            start_timeout(&engine_unit),
        );
    }
    let meta = fs::metadata(&runtime_dir).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o700);
    if !env.contains_key("HARRIER_MODEL") {
        // No model set: the engine serves the embedded one from its StateDirectory.
        assert!(
            home.join("models/harrier-cpu/.harrier-embedded").is_file(),
            "the embedded default model is not under HARRIER_HOME ({})",
            home.display()
        );
    }

    // Two front ends, both on the same port.
    let mut fronts = Vec::new();
    for instance in ["0", "1"] {
        let name = format!("frontend@{instance}");
        let argv = exec(&fe_unit, "ExecStart", instance, &env);
        assert_eq!(argv.len(), 1);
        let mut p = spawn(&name, &argv[0], &env, &cwd_of(&fe_unit), &logs);
        let mut env_post = env.clone();
        env_post.insert("MAINPID".into(), p.pid().to_string());
        for post in exec(&fe_unit, "ExecStartPost", instance, &env_post) {
            run_post(
                &name,
                &post,
                &env_post,
                &cwd_of(&fe_unit),
                &mut p,
                start_timeout(&fe_unit),
            );
        }
        fronts.push(p);
    }
    engine.assert_running();

    // /health through the shared port.
    let h = http(port, "GET", "/health", None);
    assert_eq!(h.status, 200, "/health: {}", h.body);
    // Both front ends answer on the shared port (the kernel spreads new connections).
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..200 {
        seen.insert(answering_frontend(port));
        if seen.len() == 2 {
            break;
        }
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        ["0", "1"],
        "both front ends should answer on port {port}"
    );
    // Streamed completions through the shared port, some concurrently.
    let streams: Vec<_> = (0..4)
        .map(|_| std::thread::spawn(move || stream_chat(port, 12)))
        .collect();
    for s in streams {
        let text = s.join().expect("a stream failed");
        assert!(!text.is_empty(), "a stream carried no text");
    }
    for p in &mut fronts {
        p.assert_running();
    }
    engine.assert_running();

    // systemctl stop harrier.target: front ends first (ordered after the engine), then the engine.
    for p in &fronts {
        p.signal("TERM");
    }
    for p in &mut fronts {
        let st = p
            .wait_timeout(stop_timeout(&fe_unit))
            .unwrap_or_else(|| panic!("{} did not stop within TimeoutStopSec", p.name));
        assert!(
            st.code() == Some(0),
            "{} exited with {st} (signal {:?}):\n{}",
            p.name,
            st.signal(),
            p.log_tail()
        );
    }
    engine.signal("TERM");
    let st = engine
        .wait_timeout(stop_timeout(&engine_unit))
        .expect("the engine did not stop within TimeoutStopSec");
    assert!(
        st.code() == Some(0),
        "engine exited with {st}:\n{}",
        engine.log_tail()
    );
    // After the engine stopped, readiness is false again (a stale socket does not count).
    let post = exec(&engine_unit, "ExecStartPost", "", &env_post);
    let mut check = post[0].clone();
    let pid_at = check.iter().position(|a| a == "--pid").unwrap();
    check.drain(pid_at..pid_at + 2);
    check.splice(1..1, ["--timeout".to_string(), "0".to_string()]);
    let st = command(&check, &env, tmp.path())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(
        !st.success(),
        "harrier-ready reports a stopped engine as ready"
    );
}

#[test]
fn command_line_expansion_follows_systemd() {
    let mut env = BTreeMap::new();
    env.insert("A".to_string(), "one two".to_string());
    env.insert("P".to_string(), "8000".to_string());
    let (prefix, argv) = expand_exec(
        "-+/bin/x --a ${A} $A $UNSET ${UNSET} tcp://h:${P} %i \"q w\" 100%% $$P",
        "3",
        &env,
    );
    assert_eq!(prefix, "-+");
    assert_eq!(
        argv,
        [
            "/bin/x",
            "--a",
            "one two",
            "one",
            "two",
            "",
            "tcp://h:8000",
            "3",
            "q w",
            "100%",
            "$P"
        ]
    );
    assert_eq!(parse_timespan("15min"), Duration::from_secs(900));
    assert_eq!(parse_timespan("2min 30s"), Duration::from_secs(150));
}
