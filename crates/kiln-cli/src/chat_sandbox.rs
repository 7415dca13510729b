//! Chat templates come with downloaded models: they are untrusted code. kiln-models renders
//! them with fuel and a cap on what they write, but minijinja builds `a ~ b` with no hook
//! to stop it, so a template that doubles a string in a namespace (or chains `~` on a long
//! one) takes gigabytes before any check sees the result, and a failed allocation aborts
//! the process. The CLI therefore renders in child processes of its own binary, limited in
//! address space and each render in time: a template that exceeds either is an error
//! naming the limit, and nothing of the parent is lost.

use crate::console::CliResult;
use kiln_core::Error;
use kiln_models::chat::{self, Message};
use std::io::{Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Condvar, Mutex};

/// The hidden first argument that makes `kiln` a renderer child.
pub const CHILD_ARG: &str = "__render-chat-template";

/// Address space of the child: the binary and its libraries take ~50 MiB; the rest is room
/// for text up to the output cap (4 MiB plus 8x the input) several times over.
const MEMORY_LIMIT: u64 = 512 << 20;

/// Seconds a render may take before its child is killed (fuel stops a loop far sooner;
/// this bounds the rest). Wall time, since a child renders many times over its life.
const WALL_SECONDS: u64 = 10;

#[derive(serde::Serialize, serde::Deserialize)]
struct Job {
    template: String,
    messages: Vec<Message>,
    bos: String,
    eos: String,
}

/// Renders one template (a model's) in children of kiln's own binary that stay up between
/// renders: starting one costs ~15 ms (measured on a 2-vCPU EPYC, 2026-11-28), as much
/// as a server's whole time to first token, where a render takes well under 1 ms. Up to
/// [`WORKERS`] children render at once, handed out from a list of idle ones; a child that
/// died (its memory limit, a signal) or overran its time is reaped and replaced.
pub struct Renderer {
    model: String,
    template: String,
    bos: String,
    eos: String,
    pool: Mutex<Pool>,
    /// Signalled when a child goes back to the pool (or a place for one frees).
    returned: Condvar,
}

/// Children a [`Renderer`] keeps.
const WORKERS: usize = 2;

/// The idle children, and how many exist (idle or rendering).
#[derive(Default)]
struct Pool {
    idle: Vec<Worker>,
    live: usize,
}

/// A renderer child and its pipes.
struct Worker {
    child: Child,
    to: ChildStdin,
    from: ChildStdout,
}

impl Renderer {
    /// A renderer of `template` (the model `model`'s; named in errors) with the model's
    /// BOS and EOS texts.
    pub fn new(model: &str, template: &str, bos: &str, eos: &str) -> Renderer {
        Renderer {
            model: model.into(),
            template: template.into(),
            bos: bos.into(),
            eos: eos.into(),
            pool: Mutex::new(Pool::default()),
            returned: Condvar::new(),
        }
    }

    /// The template rendered for `messages`.
    pub fn render(&self, messages: &[Message]) -> CliResult<String> {
        let job = serde_json::to_vec(&Job {
            template: self.template.clone(),
            messages: messages.to_vec(),
            bos: self.bos.clone(),
            eos: self.eos.clone(),
        })
        .map_err(|e| Error::format(format!("chat template of {}: {e}", self.model)))?;
        let len = u32::try_from(job.len()).map_err(|_| {
            Error::format(format!("chat of {}: the messages pass 4 GiB", self.model))
        })?;
        let (mut worker, mut fresh) = self.take()?;
        loop {
            match exchange(&mut worker, len, &job) {
                Ok(reply) => {
                    self.give_back(Some(worker));
                    return match reply {
                        Reply::Text(text) => Ok(text),
                        Reply::Refused(said) => {
                            Err(Error::format(format!("{}: {said}", self.model)).into())
                        }
                    };
                }
                // A kept child that had died while idle (killed from outside): this job
                // never reached it, so it goes to a new one.
                Err(Exchange::NotSent(_)) if !fresh => {
                    stop(Some(worker));
                    worker = spawn().inspect_err(|_| self.give_back(None))?;
                    fresh = true;
                }
                Err(failure) => {
                    stop(Some(worker));
                    self.give_back(None);
                    return Err(failure.into_error(&self.model).into());
                }
            }
        }
    }

    /// An idle child, a new one while fewer than [`WORKERS`] exist, else the first to be
    /// given back; and whether it is new. Idle children that exited are replaced.
    fn take(&self) -> Result<(Worker, bool), Error> {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(mut w) = pool.idle.pop() {
                if matches!(w.child.try_wait(), Ok(None)) {
                    return Ok((w, false));
                }
                let _ = w.child.wait();
                pool.live -= 1;
                continue;
            }
            if pool.live < WORKERS {
                pool.live += 1;
                drop(pool);
                return spawn()
                    .map(|w| (w, true))
                    .inspect_err(|_| self.give_back(None));
            }
            pool = self.returned.wait(pool).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// A child back to the pool, or (None) the place of one that was stopped.
    fn give_back(&self, worker: Option<Worker>) {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        match worker {
            Some(w) => pool.idle.push(w),
            None => pool.live -= 1,
        }
        drop(pool);
        self.returned.notify_one();
    }
}

impl Drop for Renderer {
    fn drop(&mut self) {
        let pool = self.pool.get_mut().unwrap_or_else(|e| e.into_inner());
        for w in pool.idle.drain(..) {
            stop(Some(w));
        }
    }
}

/// `template` rendered once for `messages` (`kiln run --chat`).
pub fn render(
    model: &str,
    template: &str,
    messages: &[Message],
    bos: &str,
    eos: &str,
) -> CliResult<String> {
    Renderer::new(model, template, bos, eos).render(messages)
}

fn spawn() -> Result<Worker, Error> {
    let mut cmd = Command::new(own_binary()?);
    cmd.arg(CHILD_ARG)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    limit_child(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::io("starting the chat-template renderer", e))?;
    match (child.stdin.take(), child.stdout.take()) {
        (Some(to), Some(from)) => Ok(Worker { child, to, from }),
        _ => {
            let _ = child.kill();
            let _ = child.wait();
            Err(Error::format(
                "the chat-template renderer started without its pipes",
            ))
        }
    }
}

/// Kill and reap a child, if there is one.
fn stop(worker: Option<Worker>) {
    if let Some(mut w) = worker {
        let _ = w.child.kill();
        let _ = w.child.wait();
    }
}

enum Reply {
    Text(String),
    /// The template's own error (a raise, a syntax error, fuel): the child goes on.
    Refused(String),
}

enum Exchange {
    /// The job could not be written: the child had exited (how, as the end of a sentence).
    NotSent(String),
    /// The template took the child past a limit (its memory, its time): why, as the end of
    /// a sentence about the template.
    Limit(String),
    /// The child died another way (a signal from outside), or its reply was not text.
    Failed(String),
}

impl Exchange {
    /// The error a request gets: the template's (a format error: its fault, 400) for a
    /// limit, else the renderer's (an I/O error: not the messages' fault, 500).
    fn into_error(self, model: &str) -> Error {
        match self {
            Exchange::Limit(why) => Error::format(format!(
                "{model}: the chat template {why}; fix or replace the model's chat template"
            )),
            Exchange::NotSent(why) | Exchange::Failed(why) => Error::io(
                format!("the chat-template renderer of {model}"),
                std::io::Error::other(why),
            ),
        }
    }
}

/// Send one job (`len` bytes) and read its reply within [`WALL_SECONDS`].
fn exchange(w: &mut Worker, len: u32, job: &[u8]) -> Result<Reply, Exchange> {
    let sent =
        w.to.write_all(&len.to_le_bytes())
            .and_then(|_| w.to.write_all(job))
            .and_then(|_| w.to.flush());
    if sent.is_err() {
        return Err(Exchange::NotSent(died(w).1));
    }
    if !readable_within(&w.from, WALL_SECONDS) {
        let _ = w.child.kill();
        return Err(Exchange::Limit(format!(
            "ran out of its {WALL_SECONDS} s to render (it runs without bound)"
        )));
    }
    let mut head = [0u8; 5];
    let mut body = Vec::new();
    let read = w.from.read_exact(&mut head).and_then(|_| {
        body.resize(
            u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize,
            0,
        );
        w.from.read_exact(&mut body)
    });
    if read.is_err() {
        return Err(match died(w) {
            (true, why) => Exchange::Limit(why),
            (false, why) => Exchange::Failed(why),
        });
    }
    let text = String::from_utf8(body)
        .map_err(|_| Exchange::Failed("sent text that is not UTF-8".into()))?;
    Ok(if head[0] == 0 {
        Reply::Text(text)
    } else {
        Reply::Refused(text)
    })
}

/// Why a child whose pipe closed stopped (reaped here: it closes them only by exiting),
/// and whether that was the template's doing (its memory limit, its alarm).
fn died(w: &mut Worker) -> (bool, String) {
    match w.child.wait() {
        Ok(status) => stopped_by(&status),
        Err(e) => (false, format!("could not be waited for ({e})")),
    }
}

/// Whether `from` has something to read (or was closed) within `seconds`.
#[cfg(unix)]
fn readable_within(from: &ChildStdout, seconds: u64) -> bool {
    use std::os::unix::io::AsRawFd;
    let mut fds = libc::pollfd {
        fd: from.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        // SAFETY: poll reads and writes only the one pollfd passed.
        let r = unsafe { libc::poll(&mut fds, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if r > 0 {
            return true;
        }
        if r == 0 {
            return false;
        }
        if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return true; // the read that follows reports what is wrong
        }
    }
}

#[cfg(not(unix))]
fn readable_within(_from: &ChildStdout, _seconds: u64) -> bool {
    true
}

/// The running binary, to start as the renderer. On Linux the kernel's link to it, which
/// still runs after the file on disk was replaced or deleted (a server upgraded or rebuilt
/// in place kept failing every chat with "No such file or directory").
fn own_binary() -> Result<std::path::PathBuf, Error> {
    #[cfg(target_os = "linux")]
    {
        let link = std::path::PathBuf::from("/proc/self/exe");
        if link.exists() {
            return Ok(link);
        }
    }
    std::env::current_exe()
        .map_err(|e| Error::io("finding kiln's own binary to render the chat template", e))
}

#[cfg(unix)]
fn limit_child(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let set = |resource, value: u64| {
        let mut now = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit write and read only the struct passed.
        unsafe {
            if libc::getrlimit(resource, &mut now) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Only the soft limit, and only ever lowered (a caller's tighter one stays).
            let lim = libc::rlimit {
                rlim_cur: (value as libc::rlim_t).min(now.rlim_cur),
                rlim_max: now.rlim_max,
            };
            if libc::setrlimit(resource, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    };
    // SAFETY: between fork and exec the hook calls only async-signal-safe functions
    // (getrlimit, setrlimit) and allocates nothing.
    unsafe {
        cmd.pre_exec(move || set(libc::RLIMIT_AS, MEMORY_LIMIT));
    }
    // A group of its own: a Ctrl-C (or a service manager's stop of the server's group)
    // reaches the server, which finishes the chats in flight, and not the renderers those
    // chats wait on. They end at the end of their input.
    cmd.process_group(0);
}

#[cfg(not(unix))]
fn limit_child(_cmd: &mut Command) {}

/// What stopped the child, as the end of a sentence about the template, and whether the
/// template did (its memory limit, or its own alarm: see [`child_main`]).
fn stopped_by(status: &std::process::ExitStatus) -> (bool, String) {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        let mib = MEMORY_LIMIT >> 20;
        match status.signal() {
            Some(libc::SIGABRT) => {
                return (
                    true,
                    format!("ran out of its {mib} MiB of memory (it builds text without bound)"),
                )
            }
            Some(libc::SIGALRM) => {
                return (
                    true,
                    format!("ran out of its {WALL_SECONDS} s to render (it runs without bound)"),
                )
            }
            Some(sig) => return (false, format!("was stopped by signal {sig}")),
            None => {}
        }
    }
    (false, format!("ended ({status})"))
}

/// The child's side: jobs on stdin, each a little-endian u32 length and the job's JSON;
/// for each a reply on stdout: a byte (0: text, 1: the template's error), a u32 length and
/// the text. Ends at the end of its input.
pub fn child_main() -> std::process::ExitCode {
    let (mut input, mut output) = (std::io::stdin().lock(), std::io::stdout().lock());
    loop {
        let mut len = [0u8; 4];
        match input.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return std::process::ExitCode::SUCCESS
            }
            Err(_) => return std::process::ExitCode::from(1),
        }
        let mut job = vec![0u8; u32::from_le_bytes(len) as usize];
        if input.read_exact(&mut job).is_err() {
            return std::process::ExitCode::from(1);
        }
        // The render's own time limit, a little past the parent's: it ends this process
        // even when the parent died mid-render and no one is left to kill it.
        set_alarm(WALL_SECONDS + 1);
        let text = serde_json::from_slice::<Job>(&job)
            .map_err(|e| e.to_string())
            .and_then(|j| {
                chat::render(&j.template, &j.messages, &j.bos, &j.eos).map_err(|e| e.to_string())
            });
        set_alarm(0);
        let (tag, body) = match text {
            Ok(text) => (0u8, text),
            Err(e) => (1u8, e.replace(['\n', '\r'], " ")),
        };
        let Ok(n) = u32::try_from(body.len()) else {
            return std::process::ExitCode::from(1);
        };
        let sent = output
            .write_all(&[tag])
            .and_then(|_| output.write_all(&n.to_le_bytes()))
            .and_then(|_| output.write_all(body.as_bytes()))
            .and_then(|_| output.flush());
        if sent.is_err() {
            return std::process::ExitCode::from(1);
        }
    }
}

/// SIGALRM (whose default ends the process) in `seconds`; 0 cancels it.
#[cfg(unix)]
fn set_alarm(seconds: u64) {
    // SAFETY: alarm only sets the process's timer.
    unsafe {
        libc::alarm(seconds as libc::c_uint);
    }
}

#[cfg(not(unix))]
fn set_alarm(_seconds: u64) {}
