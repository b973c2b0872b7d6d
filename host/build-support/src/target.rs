//! Makes sure the compiler that builds the guest has the `wasm32-wasip2`
//! target, before anything is compiled for it.
//!
//! `rust-toolchain.toml` lists the target, but rustup adds listed targets
//! only when it installs the toolchain: on a machine where the pinned
//! toolchain is already there, the target may be missing, and the guest
//! build would fail late with "can't find crate for `core`". The build
//! scripts call [`Toolchain::ensure_target`] first: where rustup is present
//! it adds the target (and the caller says so in a cargo warning); where it
//! is not, it fails at once with the one command to run.

use std::env;
use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The target the guest components are compiled for.
pub const GUEST_TARGET: &str = "wasm32-wasip2";

/// The compiler a build uses, and how to add a target to it.
#[derive(Debug, Clone)]
pub struct Toolchain {
    rustc: PathBuf,
    rustc_args: Vec<OsString>,
    name: Option<String>,
    rustup: Option<PathBuf>,
}

/// What [`Toolchain::ensure_target`] found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ensured {
    /// The target was already installed.
    Present,
    /// The target was missing and this command added it.
    Added {
        /// The command that was run, as a user would type it.
        command: String,
    },
}

/// Why the target is not there and could not be added.
#[derive(Debug)]
pub enum TargetError {
    /// The compiler could not tell where its target libraries live.
    Rustc {
        /// The compiler that was asked.
        rustc: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The target is missing and was not added.
    Missing {
        /// The command that adds it.
        command: String,
        /// Why it was not added automatically.
        reason: String,
    },
}

impl fmt::Display for TargetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TargetError::Rustc { rustc, reason } => write!(
                f,
                "cannot ask {} where the {GUEST_TARGET} target's libraries live: {reason}",
                rustc.display()
            ),
            TargetError::Missing { command, reason } => write!(
                f,
                "the {GUEST_TARGET} target, which the idem guest is compiled for, is not \
                 installed ({reason}). Run: {command}"
            ),
        }
    }
}

impl std::error::Error for TargetError {}

impl Toolchain {
    /// A toolchain with the compiler `rustc`, named `name` for rustup
    /// (`None`: rustup's default), whose targets `rustup` adds (`None`: no
    /// rustup).
    pub fn new(rustc: impl Into<PathBuf>, name: Option<String>, rustup: Option<PathBuf>) -> Self {
        Toolchain {
            rustc: rustc.into(),
            rustc_args: Vec::new(),
            name,
            rustup,
        }
    }

    /// Passes `args` to every `rustc` call as well (for instance
    /// `--sysroot DIR`).
    pub fn with_rustc_args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.rustc_args.extend(args.into_iter().map(Into::into));
        self
    }

    /// The toolchain of the running build script: the `RUSTC` cargo gives
    /// it; named as rustup names the active toolchain (`RUSTUP_TOOLCHAIN`,
    /// which is the pinned one unless the user chose another, e.g. with
    /// `cargo +nightly`), else as `root/rust-toolchain.toml` pins it; and
    /// `rustup` from `PATH` or `CARGO_HOME/bin`.
    pub fn from_build_env(root: &Path) -> Self {
        let rustc = env::var_os("RUSTC").map_or_else(|| PathBuf::from("rustc"), PathBuf::from);
        let name = env::var("RUSTUP_TOOLCHAIN")
            .ok()
            .filter(|name| !name.is_empty())
            .or_else(|| pinned_channel(root));
        Toolchain::new(rustc, name, find_rustup())
    }

    /// The directory where this compiler looks for the target's libraries.
    ///
    /// # Errors
    ///
    /// [`TargetError::Rustc`] when the compiler cannot be run or does not
    /// answer with a directory.
    pub fn target_libdir(&self) -> Result<PathBuf, TargetError> {
        let rustc_error = |reason: String| TargetError::Rustc {
            rustc: self.rustc.clone(),
            reason,
        };
        let output = Command::new(&self.rustc)
            .args(&self.rustc_args)
            .args(["--print", "target-libdir", "--target", GUEST_TARGET])
            .output()
            .map_err(|e| rustc_error(e.to_string()))?;
        if !output.status.success() {
            return Err(rustc_error(format!(
                "it exited with {}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )));
        }
        let text = String::from_utf8(output.stdout)
            .map_err(|_| rustc_error("it printed a path that is not UTF-8".to_owned()))?;
        let dir = text.trim();
        if dir.is_empty() {
            return Err(rustc_error("it printed nothing".to_owned()));
        }
        Ok(PathBuf::from(dir))
    }

    /// True when the target's `core` library is installed.
    ///
    /// # Errors
    ///
    /// As [`Toolchain::target_libdir`].
    pub fn has_target(&self) -> Result<bool, TargetError> {
        Ok(has_core(&self.target_libdir()?))
    }

    /// The command that adds the target, as a user would type it.
    pub fn add_command(&self) -> String {
        match &self.name {
            Some(name) => format!("rustup target add --toolchain {name} {GUEST_TARGET}"),
            None => format!("rustup target add {GUEST_TARGET}"),
        }
    }

    /// Makes sure the target is installed: adds it with rustup when it is
    /// missing and rustup is there.
    ///
    /// # Errors
    ///
    /// [`TargetError::Missing`] when the target is missing and there is no
    /// rustup, rustup failed, or the target is still missing after it ran;
    /// [`TargetError::Rustc`] as [`Toolchain::target_libdir`].
    pub fn ensure_target(&self) -> Result<Ensured, TargetError> {
        if self.has_target()? {
            return Ok(Ensured::Present);
        }
        let command = self.add_command();
        let missing = |reason: String| TargetError::Missing {
            command: command.clone(),
            reason,
        };
        let Some(rustup) = &self.rustup else {
            return Err(missing(
                "rustup was not found on PATH, so it could not be added automatically; \
                 without rustup, install your Rust distribution's wasm32-wasip2 standard library"
                    .to_owned(),
            ));
        };
        let mut add = Command::new(rustup);
        add.args(["target", "add"]);
        if let Some(name) = &self.name {
            add.args(["--toolchain", name]);
        }
        add.arg(GUEST_TARGET);
        // rustup's own progress goes to the build script's stderr, which
        // cargo shows if the build fails.
        let output = add
            .output()
            .map_err(|e| missing(format!("running {} failed: {e}", rustup.display())))?;
        if !output.status.success() {
            return Err(missing(format!(
                "`{command}` exited with {}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )));
        }
        if !self.has_target()? {
            return Err(missing(format!(
                "`{command}` succeeded, but this compiler ({}) still has no {GUEST_TARGET} \
                 libraries: is it rustup's toolchain?",
                self.rustc.display()
            )));
        }
        Ok(Ensured::Added { command })
    }
}

/// Runs [`Toolchain::ensure_target`] for a build script: says in a cargo
/// warning when it added the target; on failure prints the error as a cargo
/// warning and on stderr, and exits the build script with status 1 so the
/// build stops at once.
pub fn ensure_target_for_build(root: &Path) {
    match Toolchain::from_build_env(root).ensure_target() {
        Ok(Ensured::Present) => {}
        Ok(Ensured::Added { command }) => {
            println!(
                "cargo:warning=the {GUEST_TARGET} target was missing; added it with `{command}`"
            );
        }
        Err(err) => {
            println!("cargo:warning={err}");
            eprintln!("error: {err}");
            std::process::exit(1);
        }
    }
}

/// True when `libdir` holds the target's `core` library.
fn has_core(libdir: &Path) -> bool {
    // A directory that cannot be read has no usable `core` either.
    let Ok(entries) = fs::read_dir(libdir) else {
        return false;
    };
    entries.filter_map(Result::ok).any(|entry| {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        name.starts_with("libcore-") && name.ends_with(".rlib")
    })
}

/// The `channel` that `root/rust-toolchain.toml` pins, if any.
pub fn pinned_channel(root: &Path) -> Option<String> {
    let text = fs::read_to_string(root.join("rust-toolchain.toml")).ok()?;
    text.lines().find_map(|line| {
        let value = line.trim().strip_prefix("channel")?.trim_start();
        let value = value.strip_prefix('=')?.trim();
        let value = value.strip_prefix('"')?;
        let end = value.find('"')?;
        Some(value[..end].to_owned())
    })
}

/// `rustup` on `PATH`, else in `CARGO_HOME/bin` (or `~/.cargo/bin`).
fn find_rustup() -> Option<PathBuf> {
    let name = if cfg!(windows) {
        "rustup.exe"
    } else {
        "rustup"
    };
    let on_path = env::var_os("PATH")
        .into_iter()
        .flat_map(|path| env::split_paths(&path).collect::<Vec<_>>())
        .map(|dir| dir.join(name));
    let cargo_home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|home| Path::new(&home).join(".cargo")))
        .map(|home| home.join("bin").join(name));
    on_path
        .chain(cargo_home)
        .find(|candidate| is_file(candidate))
}

fn is_file(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file())
}
