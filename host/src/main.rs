//! `idem`: the idempotency proxy (`idem serve`) and its operator commands
//! (`inspect`, `sweep`, `reconcile`, `stats`) against the same database.

use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod operator;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use idem::proxy::{Proxy, ProxyConfig, serve, serve_with};
use idem::{Engine, KeyStatus, ReconcileReport, SqliteOptions, SqliteStore, Status, Storage};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::watch;

/// The process's allocator: mimalloc instead of the system's. Under load
/// glibc's `malloc` and `free` took about 4 % of `idem serve`'s samples
/// (`_int_free`, `malloc_consolidate`); with mimalloc the bench suite's
/// proxy part measured 3 to 6 % less CPU per request than the same build
/// on the system allocator in nine of ten same-run comparisons (five
/// kinds of load, two runs) and 3.5 % more in the tenth (the README's
/// Performance section has the figures).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// An idempotency proxy and engine: the first request for a key runs, its
/// duplicates get the stored answer.
#[derive(Debug, Parser)]
#[command(name = "idem", version)]
struct Cli {
    /// The database: a SQLite file (created with its schema on first use),
    /// or a postgres:// (postgresql://) URL that several idem hosts share.
    #[arg(long, global = true, default_value = "./idem.db")]
    db: OsString,
    /// With a PostgreSQL --db: the schema that holds idem's tables (created
    /// with them on first use).
    #[arg(long, global = true, default_value = "public")]
    pg_schema: String,
    /// The TOML configuration file (see idem.example.toml).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Print machine-readable JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// For tests only: read the time as the system clock plus the
    /// milliseconds written in this file (one decimal number, read again at
    /// every reading), so a test moves every idem process's time forward by
    /// rewriting one file instead of waiting a lease out.
    #[arg(long, global = true, value_name = "FILE", hide_short_help = true)]
    clock_offset_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

impl Cli {
    /// The clock every part of this command reads: the system clock, or
    /// the one `--clock-offset-file` shifts.
    fn clock(&self) -> Arc<dyn idem::Clock> {
        match &self.clock_offset_file {
            Some(path) => {
                tracing::warn!(
                    file = %path.display(),
                    "the clock is shifted by --clock-offset-file: for tests only"
                );
                Arc::new(idem::OffsetFileClock::new(path))
            }
            None => Arc::new(idem::SystemClock::new()),
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the HTTP proxy in front of an upstream.
    Serve {
        /// The address to listen on (port 0 picks a free port).
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
        /// The upstream, e.g. http://127.0.0.1:9000.
        #[arg(long)]
        upstream: String,
        /// The address of the admin server (/healthz, /metrics, and the
        /// operator endpoints /keys/... for a bearer of the token in
        /// IDEM_ADMIN_TOKEN); none by default. An address other machines can
        /// reach needs IDEM_ADMIN_TOKEN set.
        #[arg(long)]
        admin: Option<String>,
        /// Threads that serve requests, each with its own listener on
        /// --listen (SO_REUSEPORT) and its own event loop; one per CPU by
        /// default.
        #[arg(long)]
        workers: Option<std::num::NonZeroUsize>,
    },
    /// Show the stored state of one key.
    Inspect(operator::KeyArgs),
    /// List the stuck keys of a biz type: in progress past their lease (the
    /// owner crashed), or outcome-unknown; oldest first.
    Stuck {
        /// The biz type.
        #[arg(long)]
        biz: String,
        /// The most keys to list.
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Start after this cursor (the last listed key's, from --json or
        /// the text listing): the next page.
        #[arg(long)]
        after: Option<String>,
    },
    /// Settle a stuck key by an operator's decision: succeeded (with the
    /// response to replay), failed for good, or released for a new run.
    /// Exits non-zero when the key was not stuck or has no record.
    Settle(operator::SettleArgs),
    /// Delete every expired key, in batches, and release the stuck keys
    /// that waited past their biz type's stuck_retention_ms (each printed).
    Sweep {
        /// Keys per batch (default: sweep_batch from the config, 1000).
        #[arg(long)]
        limit: Option<u32>,
    },
    /// Settle stale keys of a biz type (expired leases, outcome unknown).
    Reconcile {
        /// The biz type; its policy comes from --config or the defaults.
        #[arg(long)]
        biz: String,
        /// The most keys to examine.
        #[arg(long, default_value_t = 1000)]
        limit: u32,
    },
    /// Count the stored keys by state.
    Stats,
    /// Write the embedded engine component (the `.wasm` every host runs) to
    /// a file, and print its SHA-256.
    GuestWasm {
        /// Where to write the component.
        #[arg(long)]
        out: PathBuf,
    },
    /// Write the embedded middleware component (the engine plus a
    /// `wasi:http` handler that wraps another) to a file, and print its
    /// SHA-256.
    #[cfg(feature = "middleware")]
    MiddlewareWasm {
        /// Where to write the component.
        #[arg(long)]
        out: PathBuf,
    },
    /// Plug a `wasi:http` handler component into the middleware (as `wac
    /// plug` does): the result serves the handler with idempotency.
    #[cfg(feature = "middleware")]
    Compose {
        /// The handler component: exports `wasi:http/incoming-handler@0.2.x`.
        #[arg(long)]
        handler: PathBuf,
        /// Where to write the composed component.
        #[arg(long)]
        out: PathBuf,
        /// A middleware component to use instead of the embedded one.
        #[arg(long)]
        middleware: Option<PathBuf>,
    },
    /// Serve a composed middleware component over HTTP, with --db (SQLite
    /// or PostgreSQL) as its store and the routes, policies and guest
    /// bounds of --config (`wasmtime serve` cannot: it does not supply
    /// idem's imports).
    #[cfg(feature = "middleware")]
    ServeComponent {
        /// The composed component (see `idem compose`).
        component: PathBuf,
        /// The address to listen on (port 0 picks a free port).
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    init_logging();
    let config = match &cli.config {
        Some(path) => ProxyConfig::from_file(path)?,
        None => ProxyConfig::default(),
    };
    match &cli.command {
        Command::Serve {
            listen,
            upstream,
            admin,
            workers,
        } => run_serve(&cli, config, listen, upstream, admin.as_deref(), *workers),
        Command::Inspect(args) => {
            let engine = open(&cli, &config)?.engine(&config, cli.clock())?;
            let key = args.record_key()?;
            let status = engine.inspect(&key)?;
            print_inspect(cli.json, &key.scope, &args.biz, &args.key, status.as_ref())
        }
        Command::Stuck { biz, limit, after } => {
            let store = open(&cli, &config)?.shared();
            let now = cli.clock().now();
            operator::stuck(store.as_ref(), biz, now, after.as_deref(), *limit, cli.json)
        }
        Command::Settle(args) => {
            let engine = open(&cli, &config)?.engine(&config, cli.clock())?;
            let policy = config.policy_for(&args.key.biz);
            operator::settle(&engine, &policy, args, cli.json)
        }
        Command::Sweep { limit } => {
            let db = open(&cli, &config)?;
            let engine = db.engine(&config, cli.clock())?;
            let batch = limit.unwrap_or(config.sweep_batch);
            if batch == 0 {
                bail!("--limit must be at least 1");
            }
            let mut total = 0u64;
            loop {
                let deleted = engine.sweep(batch)?;
                if deleted == 0 {
                    break;
                }
                total += u64::from(deleted);
            }
            let now = engine.clock().now();
            let released = idem::operator::expire_stuck_keys(
                &engine,
                db.shared().as_ref(),
                &config,
                now,
                batch,
            )?;
            if cli.json {
                println!(
                    "{}",
                    serde_json::json!({ "deleted": total, "stuck_released": released })
                );
            } else {
                println!("deleted {total} expired keys");
                for k in &released {
                    println!(
                        "released stuck key {} ({} for {} ms, biz type {}, scope {})",
                        k.key, k.status, k.stuck_ms, k.biz_type, k.scope
                    );
                }
            }
            Ok(())
        }
        Command::Reconcile { biz, limit } => {
            if config.lookup_for(biz).is_none() {
                bail!(
                    "biz type '{biz}' has no lookup (the `lookup` of its route in --config): nothing could tell whether its stuck keys took effect, so reconcile would change nothing; settle them with `idem settle`"
                );
            }
            let engine = open(&cli, &config)?.engine(&config, cli.clock())?;
            let policy = config.policy_for(biz);
            let report = engine.reconcile(biz, &policy, *limit)?;
            print_reconcile(cli.json, biz, &report)
        }
        Command::GuestWasm { out } => write_wasm(idem::engine::DEFAULT_GUEST, out),
        #[cfg(feature = "middleware")]
        Command::MiddlewareWasm { out } => write_wasm(idem::middleware::MIDDLEWARE_GUEST, out),
        #[cfg(feature = "middleware")]
        Command::Compose {
            handler,
            out,
            middleware,
        } => {
            let read =
                |p: &Path| std::fs::read(p).with_context(|| format!("cannot read {}", p.display()));
            let middleware = match middleware {
                Some(path) => read(path)?,
                None => idem::middleware::MIDDLEWARE_GUEST.to_vec(),
            };
            let composed = idem::middleware::compose(&middleware, &read(handler)?)?;
            write_wasm(&composed, out)
        }
        #[cfg(feature = "middleware")]
        Command::ServeComponent { component, listen } => {
            run_serve_component(&cli, &config, component, listen)
        }
        Command::Stats => {
            let counts = open(&cli, &config)?.shared().count_by_status()?;
            print_stats(cli.json, &counts)
        }
    }
}

/// Writes a component (such as [`idem::engine::DEFAULT_GUEST`]) to `out`
/// and prints its digest, so that hosts in other languages load the very
/// bytes the Rust host runs.
fn write_wasm(wasm: &[u8], out: &Path) -> Result<()> {
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the directory {}", dir.display()))?;
    }
    std::fs::write(out, wasm).with_context(|| format!("cannot write {}", out.display()))?;
    let digest: String = Sha256::digest(wasm)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    println!("{digest}  {} ({} bytes)", out.display(), wasm.len());
    Ok(())
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// The store `--db` names.
enum Db {
    Sqlite(SqliteStore),
    #[cfg(feature = "postgres")]
    Postgres(idem::PostgresStore),
}

impl Db {
    /// An engine on this store, bounded as `config` says, reading `clock`.
    fn engine(&self, config: &ProxyConfig, clock: Arc<dyn idem::Clock>) -> Result<Engine> {
        let mut builder = Engine::builder()
            .bounds(config.guest_bounds()?)
            .clock(clock);
        if let Some(lookup) = idem::lookup::HttpLookup::from_config(config) {
            builder = builder.results(lookup);
        }
        let builder = match self {
            Db::Sqlite(s) => builder.storage(s.clone()),
            #[cfg(feature = "postgres")]
            Db::Postgres(p) => builder.storage(p.clone()),
        };
        Ok(builder.build()?)
    }

    fn shared(&self) -> Arc<dyn Storage> {
        match self {
            Db::Sqlite(s) => Arc::new(s.clone()),
            #[cfg(feature = "postgres")]
            Db::Postgres(p) => Arc::new(p.clone()),
        }
    }
}

/// True when `--db` is a PostgreSQL URL rather than a file path.
fn is_postgres_url(db: &OsStr) -> bool {
    db.to_str().is_some_and(|s| {
        let lower = s.get(..13).unwrap_or(s).to_ascii_lowercase();
        lower.starts_with("postgres://") || lower.starts_with("postgresql://")
    })
}

fn open(cli: &Cli, config: &ProxyConfig) -> Result<Db> {
    if is_postgres_url(&cli.db) {
        return open_postgres(cli);
    }
    let path = Path::new(&cli.db);
    let options = SqliteOptions {
        group_commit: config.group_commit,
        ..Default::default()
    };
    let store = SqliteStore::open(path, options)
        .with_context(|| format!("cannot open the database {}", path.display()))?;
    Ok(Db::Sqlite(store))
}

#[cfg(feature = "postgres")]
fn open_postgres(cli: &Cli) -> Result<Db> {
    let url = cli.db.to_str().context("--db is not UTF-8")?;
    let options = idem::PostgresOptions {
        schema: cli.pg_schema.clone(),
        ..Default::default()
    };
    // The URL may carry a password: name the schema, never the URL.
    let store = idem::PostgresStore::connect(url, options).with_context(|| {
        format!(
            "cannot open the PostgreSQL database (schema {})",
            cli.pg_schema
        )
    })?;
    Ok(Db::Postgres(store))
}

#[cfg(not(feature = "postgres"))]
fn open_postgres(_cli: &Cli) -> Result<Db> {
    bail!(
        "--db names a PostgreSQL database, but this idem was built without the `postgres` feature"
    )
}

/// The environment variable that holds the admin server's bearer token
/// (an environment variable, not a flag: flags show in `ps`).
const ADMIN_TOKEN_VAR: &str = "IDEM_ADMIN_TOKEN";

fn run_serve(
    cli: &Cli,
    mut config: ProxyConfig,
    listen: &str,
    upstream: &str,
    admin: Option<&str>,
    workers: Option<std::num::NonZeroUsize>,
) -> Result<()> {
    let upstream: http::Uri = upstream
        .parse()
        .with_context(|| format!("--upstream '{upstream}' is not a URI"))?;
    let db = open(cli, &config)?;
    if config.outcome_journal.is_none()
        && let Db::Sqlite(store) = &db
    {
        // Beside the database: whoever restarts the proxy on this file
        // finds the outcomes it could not store.
        let mut journal = store.path().as_os_str().to_owned();
        journal.push("-outcomes");
        config.outcome_journal = Some(journal.into());
    }
    let engine = db.engine(&config, cli.clock())?;
    let store = db.shared();
    let mut proxy = Proxy::new(engine, store, config, upstream)?;
    let admin_token = std::env::var(ADMIN_TOKEN_VAR)
        .ok()
        .filter(|t| !t.is_empty());
    if let Some(token) = &admin_token {
        proxy = proxy.with_admin_token(token.as_str());
    }
    let workers = workers
        .or_else(|| std::thread::available_parallelism().ok())
        .map_or(1, std::num::NonZeroUsize::get);
    serve_per_thread(proxy, listen, admin, workers)
}

/// Serves `proxy` on `workers` threads, each running a current-thread
/// runtime that accepts on a listener of its own, all bound to `listen`
/// with `SO_REUSEPORT` so the kernel spreads connections over them.
///
/// A connection is served start to end by the thread that accepted it, its
/// engine calls included (inline for SQLite; on that runtime's blocking
/// pool for PostgreSQL). With one runtime shared by every thread, each
/// request woke a second worker to steal it and parked it again: most of a
/// replay's CPU time went to those wake-ups, not to serving it.
///
/// The first worker runs on this thread and also carries the signal
/// handler, the admin server and the sweeper. On SIGINT or SIGTERM every
/// worker stops accepting, finishes its connections' requests, and then
/// waits until the requests of every worker whose client hung up have
/// stored their outcome, so that no runtime stops while one is running.
fn serve_per_thread(proxy: Proxy, listen: &str, admin: Option<&str>, workers: usize) -> Result<()> {
    let runtimes = (0..workers.max(1))
        .map(|_| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("cannot start the async runtime")
        })
        .collect::<Result<Vec<_>>>()?;
    let (first, others) = runtimes.split_first().context("no runtime to serve on")?;
    // Install the signal handlers before announcing the address: a signal
    // sent as soon as the line is read must stop the server cleanly.
    let signals = first.block_on(async { Signals::install() })?;
    // Outcomes a previous run answered but could not store go to the store
    // before any request is served.
    let held = first.block_on(proxy.layer().recover_outcomes());
    if held > 0 {
        tracing::warn!(
            held,
            "outcomes of a previous run are not stored yet; their keys wait until they are"
        );
    }
    let admin_listener = match admin {
        Some(addr) => Some(first.block_on(async {
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on --admin {addr}"))
        })?),
        None => None,
    };
    if let Some(l) = &admin_listener
        && !l.local_addr()?.ip().is_loopback()
        && !proxy.has_admin_token()
    {
        bail!(
            "--admin {} is reachable from other machines: set {ADMIN_TOKEN_VAR} to the bearer token its operator endpoints require",
            l.local_addr()?
        );
    }
    let addr = first
        .block_on(tokio::net::lookup_host(listen))
        .with_context(|| format!("cannot resolve --listen {listen}"))?
        .next()
        .with_context(|| format!("--listen {listen} names no address"))?;
    // A plain bind first: it fails, as a server's bind should, when any
    // other socket holds the port, another `idem serve` included (sockets
    // that all set SO_REUSEPORT could share it silently). With port 0 it
    // picks the port that every worker then listens on.
    let addr = std::net::TcpListener::bind(addr)
        .and_then(|probe| probe.local_addr())
        .with_context(|| format!("cannot listen on --listen {listen}"))?;
    let listener = first
        .block_on(async { bind_reuseport(addr) })
        .with_context(|| format!("cannot listen on --listen {listen}"))?;
    let mut listeners = Vec::with_capacity(others.len());
    for runtime in others {
        listeners.push(
            runtime
                .block_on(async { bind_reuseport(addr) })
                .with_context(|| format!("cannot listen on {addr} again for another worker"))?,
        );
    }
    {
        let mut out = std::io::stdout().lock();
        if let Some(l) = &admin_listener {
            writeln!(out, "idem admin on http://{}", l.local_addr()?)?;
        }
        writeln!(out, "idem listening on http://{addr}")?;
        out.flush()?;
    }

    let (stop_tx, stop_rx) = watch::channel(false);
    let mut runtimes = runtimes.into_iter();
    let first = runtimes.next().context("no runtime to serve on")?;
    let threads = runtimes
        .zip(listeners)
        .enumerate()
        .map(|(i, (runtime, listener))| {
            let proxy = proxy.clone();
            let stop = stop_rx.clone();
            std::thread::Builder::new()
                .name(format!("idem-worker-{}", i + 1))
                .spawn(move || runtime.block_on(serve_worker(proxy, listener, stop)))
                .context("cannot start a worker thread")
        })
        .collect::<Result<Vec<_>>>()?;
    let result = first.block_on(async {
        tokio::spawn(async move {
            signals.recv().await;
            tracing::info!("shutting down: finishing the requests in flight");
            let _ = stop_tx.send(true);
        });
        let sweeper = proxy.spawn_sweeper();
        let admin_task = admin_listener.map(|l| {
            let router = proxy.admin_router();
            tokio::spawn(serve(l, router, stopped(stop_rx.clone())))
        });
        let result = serve_worker(proxy.clone(), listener, stop_rx).await;
        if let Some(s) = sweeper {
            s.abort();
        }
        if let Some(task) = admin_task {
            match task.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::error!(error = %e, "the admin server failed"),
                Err(e) => tracing::error!(error = %e, "the admin server stopped"),
            }
        }
        result
    });
    for thread in threads {
        match thread.join() {
            Ok(r) => r?,
            Err(_) => bail!("a worker thread panicked"),
        }
    }
    // Dropping a runtime waits for engine calls still running on its
    // blocking threads: each is finished, none is cut half-way.
    result?;
    tracing::info!("stopped");
    Ok(())
}

/// One worker: serves its listener until `stop`, then waits for the
/// requests whose client hung up, on every worker, to store their outcome.
async fn serve_worker(
    proxy: Proxy,
    listener: TcpListener,
    stop: watch::Receiver<bool>,
) -> Result<()> {
    let result = serve_with(
        listener,
        proxy.router(),
        proxy.serve_options(),
        stopped(stop),
    )
    .await;
    proxy.finish().await;
    Ok(result?)
}

/// A listener on `addr` that other sockets of this process may bind too
/// (`SO_REUSEPORT`), with the backlog tokio's `TcpListener::bind` uses.
fn bind_reuseport(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    #[cfg(unix)]
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// The listen backlog of each worker's socket: tokio's and std's default.
const LISTEN_BACKLOG: u32 = 1024;

#[cfg(feature = "middleware")]
fn run_serve_component(
    cli: &Cli,
    config: &ProxyConfig,
    component: &Path,
    listen: &str,
) -> Result<()> {
    let wasm =
        std::fs::read(component).with_context(|| format!("cannot read {}", component.display()))?;
    let store = open(cli, config)?.shared();
    let server = idem::middleware::ComponentServer::new(&wasm, store, cli.clock(), config)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let signals = Signals::install()?;
        let listener = TcpListener::bind(listen)
            .await
            .with_context(|| format!("cannot listen on --listen {listen}"))?;
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "idem listening on http://{}", listener.local_addr()?)?;
            out.flush()?;
        }
        serve_with(
            listener,
            server.router(),
            server.serve_options(),
            signals.recv(),
        )
        .await?;
        tracing::info!("stopped");
        Ok(())
    })
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// SIGINT and SIGTERM, listened for from creation on.
struct Signals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    #[cfg(unix)]
    fn install() -> Result<Signals> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            interrupt: signal(SignalKind::interrupt()).context("cannot handle SIGINT")?,
            terminate: signal(SignalKind::terminate()).context("cannot handle SIGTERM")?,
        })
    }

    #[cfg(not(unix))]
    fn install() -> Result<Signals> {
        Ok(Signals {})
    }

    /// Completes on the first SIGINT or SIGTERM.
    #[cfg(unix)]
    async fn recv(mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }

    /// Completes on Ctrl-C.
    #[cfg(not(unix))]
    async fn recv(self) {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

fn print_inspect(
    json: bool,
    scope: &str,
    biz: &str,
    key: &str,
    status: Option<&KeyStatus>,
) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(&status)?);
        return Ok(());
    }
    let Some(s) = status else {
        println!("no record for scope '{scope}', biz type '{biz}', key '{key}'");
        return Ok(());
    };
    let opt = |t: Option<u64>| t.map(timestamp).unwrap_or_else(|| "-".into());
    println!("scope:               {scope}");
    println!("biz type:            {biz}");
    println!("key:                 {key}");
    println!(
        "status:              {}{}",
        s.status.as_str(),
        if s.expired {
            " (expired: counts as absent)"
        } else {
            ""
        }
    );
    println!("created at:          {}", timestamp(s.created_at));
    println!("updated at:          {}", timestamp(s.updated_at));
    println!("expires at:          {}", opt(s.expires_at));
    println!("lease until:         {}", opt(s.lease_until));
    println!(
        "result ref:          {}",
        s.result_ref.as_deref().unwrap_or("-")
    );
    println!("attempts:            {}", s.attempts);
    println!("fencing token:       {}", s.fencing_token);
    println!(
        "fingerprint:         {} (version {})",
        s.fingerprint, s.fingerprint_version
    );
    Ok(())
}

fn print_reconcile(json: bool, biz: &str, r: &ReconcileReport) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(r)?);
        return Ok(());
    }
    println!("reconciled biz type '{biz}':");
    println!("  examined:        {}", r.examined);
    println!("  succeeded:       {}", r.succeeded);
    println!("  released:        {}", r.released);
    println!("  left for manual: {}", r.left_for_manual);
    println!("  skipped:         {}", r.skipped);
    println!("  lookup errors:   {}", r.lookup_errors);
    if r.lookup_errors > 0 {
        println!(
            "{} key(s) could not be checked: the proxy has no business lookup, so idem cannot tell whether their upstream request took effect. They were left as they were, and still block their keys.",
            r.lookup_errors
        );
    }
    Ok(())
}

fn print_stats(json: bool, counts: &[(Status, u64)]) -> Result<()> {
    let count = |s: Status| {
        counts
            .iter()
            .filter(|(c, _)| *c == s)
            .map(|(_, n)| *n)
            .sum::<u64>()
    };
    let total: u64 = counts.iter().map(|(_, n)| n).sum();
    if json {
        let mut map = serde_json::Map::new();
        for s in Status::ALL {
            map.insert(s.as_str().into(), count(s).into());
        }
        map.insert("total".into(), total.into());
        println!("{}", serde_json::to_string_pretty(&map)?);
        return Ok(());
    }
    for s in Status::ALL {
        println!("{:<16} {}", s.as_str(), count(s));
    }
    println!("{:<16} {}", "total", total);
    Ok(())
}

/// Milliseconds since the epoch as RFC 3339 UTC, with the raw value.
fn timestamp(ms: u64) -> String {
    let secs = ms / 1000;
    let days = i64::try_from(secs / 86_400).unwrap_or(i64::MAX / 2);
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z ({ms})",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn postgres_urls_are_told_from_paths() {
        for url in [
            "postgres://u@h/db",
            "postgresql://h:5432/db?application_name=x",
            "POSTGRES://h/db",
        ] {
            assert!(is_postgres_url(OsStr::new(url)), "{url}");
        }
        for path in [
            "./idem.db",
            "/var/lib/idem.db",
            "postgres",
            "postgres:/x",
            "db://x",
        ] {
            assert!(!is_postgres_url(OsStr::new(path)), "{path}");
        }
    }

    #[test]
    fn timestamps_are_rfc_3339() {
        assert_eq!(timestamp(0), "1970-01-01T00:00:00.000Z (0)");
        assert_eq!(
            timestamp(1_700_000_000_123),
            "2023-11-14T22:13:20.123Z (1700000000123)"
        );
        assert_eq!(
            timestamp(951_782_400_000),
            "2000-02-29T00:00:00.000Z (951782400000)"
        );
    }
}
