//! Chat templates come with downloaded models: they are untrusted code. kiln-models renders
//! them with fuel and a cap on what they write, but minijinja builds `a ~ b` with no hook
//! to stop it, so a template that doubles a string in a namespace (or chains `~` on a long
//! one) takes gigabytes before any check sees the result, and a failed allocation aborts
//! the process. The CLI therefore renders in a child process of its own binary, limited in
//! address space and CPU time: a template that exceeds either is an error naming the limit,
//! and nothing of the parent is lost.

use crate::console::{CliResult, Failure};
use kiln_core::Error;
use kiln_models::chat::{self, Message};
use std::io::{Read, Write};
use std::process::{Command, Stdio};

/// The hidden first argument that makes `kiln` a renderer child.
pub const CHILD_ARG: &str = "__render-chat-template";

/// Address space of the child: the binary and its libraries take ~50 MiB; the rest is room
/// for text up to the output cap (4 MiB plus 8x the input) several times over.
const MEMORY_LIMIT: u64 = 512 << 20;

/// CPU seconds of the child (fuel stops a loop far sooner; this bounds the rest).
const CPU_SECONDS: u64 = 10;

#[derive(serde::Serialize, serde::Deserialize)]
struct Job {
    template: String,
    messages: Vec<Message>,
    bos: String,
    eos: String,
}

/// `template` rendered for `messages` in a limited child process; `model` names the
/// template's owner in errors.
pub fn render(
    model: &str,
    template: &str,
    messages: &[Message],
    bos: &str,
    eos: &str,
) -> CliResult<String> {
    let job = serde_json::to_vec(&Job {
        template: template.into(),
        messages: messages.to_vec(),
        bos: bos.into(),
        eos: eos.into(),
    })
    .map_err(|e| Error::format(format!("chat template of {model}: {e}")))?;
    let mut cmd = Command::new(own_binary()?);
    cmd.arg(CHILD_ARG)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    limit_child(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::io("starting the chat-template renderer", e))?;
    // The child reads all of its input before it writes anything: no deadlock.
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(&job)
            .map_err(|e| Error::io("sending the chat template to its renderer", e))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| Error::io("waiting for the chat-template renderer", e))?;
    if out.status.success() {
        return String::from_utf8(out.stdout).map_err(|_| {
            Failure::from(Error::format(format!(
                "chat template of {model}: the rendered text is not UTF-8"
            )))
        });
    }
    let said = String::from_utf8_lossy(&out.stderr).trim().to_string();
    if out.status.code() == Some(1) && !said.is_empty() {
        return Err(Error::format(format!("{model}: {said}")).into());
    }
    Err(Error::format(format!(
        "{model}: the chat template {} (it builds text without bound); fix or replace the model's chat template",
        stopped_by(&out.status)
    ))
    .into())
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
        cmd.pre_exec(move || {
            set(libc::RLIMIT_AS, MEMORY_LIMIT)?;
            set(libc::RLIMIT_CPU, CPU_SECONDS)
        });
    }
}

#[cfg(not(unix))]
fn limit_child(_cmd: &mut Command) {}

/// What stopped the child, as the end of a sentence about the template.
fn stopped_by(status: &std::process::ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        let mib = MEMORY_LIMIT >> 20;
        match status.signal() {
            Some(libc::SIGABRT) => return format!("ran out of its {mib} MiB of memory"),
            Some(libc::SIGXCPU) | Some(libc::SIGKILL) => {
                return format!("ran out of its {CPU_SECONDS} s of CPU time")
            }
            Some(sig) => return format!("was stopped by signal {sig}"),
            None => {}
        }
    }
    format!("renderer failed ({status})")
}

/// The child's side: read a job on stdin, write the text on stdout; an error on stderr
/// with exit status 1.
pub fn child_main() -> std::process::ExitCode {
    let mut input = Vec::new();
    let job = std::io::stdin()
        .read_to_end(&mut input)
        .map_err(|e| e.to_string())
        .and_then(|_| serde_json::from_slice::<Job>(&input).map_err(|e| e.to_string()));
    let text = job.and_then(|j| {
        chat::render(&j.template, &j.messages, &j.bos, &j.eos).map_err(|e| e.to_string())
    });
    match text {
        Ok(text) => {
            let mut out = std::io::stdout().lock();
            if out
                .write_all(text.as_bytes())
                .and_then(|_| out.flush())
                .is_ok()
            {
                std::process::ExitCode::SUCCESS
            } else {
                std::process::ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("{}", e.replace(['\n', '\r'], " "));
            std::process::ExitCode::from(1)
        }
    }
}
