//! What kiln writes for people: streamed text on stdout, log lines and errors on stderr.
//! An error or a log line must start on its own line even when generated text was left
//! without a newline, and a failure has one of two exit statuses.

use std::fmt;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether stdout was left in the middle of a line.
static STDOUT_MID_LINE: AtomicBool = AtomicBool::new(false);

/// Write `text` to stdout now (streamed generation), remembering whether its line is open.
pub fn stream(out: &mut impl Write, text: &str) {
    if text.is_empty() {
        return;
    }
    // A closed stdout (`kiln run ... | head`) is not an error worth stopping for.
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
    STDOUT_MID_LINE.store(!text.ends_with('\n'), Ordering::Relaxed);
}

/// End stdout's open line, if any, so that what stderr prints next starts a line.
pub fn end_stdout_line() {
    if STDOUT_MID_LINE.swap(false, Ordering::Relaxed) {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(b"\n");
        let _ = out.flush();
    }
}

/// How a command failed.
#[derive(Debug)]
pub enum Failure {
    /// A flag or argument that cannot be used as given (exit status 2, like clap's own).
    Usage(String),
    /// Anything else: a file, the model, the device (exit status 1).
    Kiln(kiln_core::Error),
}

pub type CliResult<T = ()> = Result<T, Failure>;

impl Failure {
    pub fn usage(msg: impl fmt::Display) -> Self {
        Failure::Usage(msg.to_string())
    }

    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::Usage(_) => 2,
            Failure::Kiln(_) => 1,
        }
    }
}

impl From<kiln_core::Error> for Failure {
    fn from(e: kiln_core::Error) -> Self {
        Failure::Kiln(e)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            Failure::Usage(msg) => msg.clone(),
            Failure::Kiln(e) => e.to_string(),
        };
        // One line, whatever a message carried (a file name may hold a newline).
        f.write_str(&text.replace(['\n', '\r'], " "))
    }
}

/// Print `failure` on stderr as `kiln: error: ...`, on a line of its own.
pub fn report(failure: &Failure) {
    end_stdout_line();
    eprintln!("kiln: error: {failure}");
}

/// Log lines on stderr: warnings by default, `-v` info (`-vv` debug, `-vvv` trace), `-q`
/// errors only; `RUST_LOG` (tracing's filter syntax) overrides both.
pub fn init_logging(verbose: u8, quiet: bool) {
    use tracing_subscriber::EnvFilter;
    let level = match (quiet, verbose) {
        (true, _) => "error",
        (false, 0) => "warn",
        (false, 1) => "info",
        (false, 2) => "debug",
        _ => "trace",
    };
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => EnvFilter::try_new(&spec).unwrap_or_else(|e| {
            eprintln!("kiln: RUST_LOG={spec:?} is not a log filter ({e}); using {level}");
            EnvFilter::new(level)
        }),
        _ => EnvFilter::new(level),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(LineStartWriter)
        .with_target(false)
        .without_time()
        .init();
}

/// stderr, after ending stdout's open line.
struct LineStartWriter;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LineStartWriter {
    type Writer = std::io::Stderr;

    fn make_writer(&'a self) -> Self::Writer {
        end_stdout_line();
        std::io::stderr()
    }
}
