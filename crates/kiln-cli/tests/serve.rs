//! `kiln serve` as a process: it binds loopback, answers, and on SIGTERM stops accepting,
//! finishes the stream in flight, and exits 0.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A started `kiln serve --port 0 ARGS`: the child, its stderr (kept open: the server
/// writes to it until it exits), its address and the line that says it.
struct Server {
    child: std::process::Child,
    stderr: BufReader<std::process::ChildStderr>,
    addr: String,
    line: String,
}

fn start(args: &[&str]) -> Server {
    start_binary(std::path::Path::new(env!("CARGO_BIN_EXE_kiln")), args)
}

fn start_binary(exe: &std::path::Path, args: &[&str]) -> Server {
    let mut child = Command::new(exe)
        .args(["serve", "--port", "0"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let mut server = Server {
        child,
        stderr,
        addr: String::new(),
        line: String::new(),
    };
    loop {
        let mut line = String::new();
        assert!(
            server.stderr.read_line(&mut line).unwrap() > 0,
            "kiln serve {args:?} ended"
        );
        if let Some(at) = line.trim().split("listening on http://").nth(1) {
            server.addr = at.to_string();
            server.line = line;
            return server;
        }
    }
}

impl Drop for Server {
    /// A test that fails leaves no server running.
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A connection that has sent `body` to `/v1/completions`.
fn post(addr: &str, body: &str) -> TcpStream {
    post_to(addr, "/v1/completions", body)
}

/// A connection that has sent `body` to `path`.
fn post_to(addr: &str, path: &str, body: &str) -> TcpStream {
    let mut conn = TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    write!(
        conn,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    conn
}

#[test]
fn sigterm_finishes_the_stream_in_flight_then_exits_0() {
    let mut server = start(&["--device", "cpu", "-t", "1"]);
    let (child, addr) = (&mut server.child, server.addr.clone());
    assert!(
        addr.starts_with("127.0.0.1:"),
        "loopback by default: {addr}"
    );

    let body = r#"{"prompt": "Permission is hereby granted", "max_tokens": 200, "ignore_eos": true, "stream": true}"#;
    let mut conn = post(&addr, body);
    // The stream has begun.
    let mut first = [0u8; 256];
    let n = conn.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));

    // SAFETY: kill sends a signal to the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let mut rest = Vec::new();
    conn.read_to_end(&mut rest).unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("data: [DONE]"), "the stream was cut: {rest}");
    assert!(rest.contains("\"finish_reason\":\"length\""), "{rest}");

    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "kiln serve did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0));
    assert!(TcpStream::connect(&addr).is_err(), "still accepting");
}

/// `kiln serve --tp 2 --device cpu`: the model split over two ranks (threads summing
/// through host memory) answers as the whole model does (greedy, the same text).
#[test]
fn a_split_server_answers_as_the_whole_one() {
    let mut texts = Vec::new();
    for tp in ["1", "2"] {
        let mut server = start(&["--device", "cpu", "-t", "2", "--tp", tp]);
        if tp == "2" {
            assert!(server.line.contains(" × 2"), "{}", server.line);
        }
        let body = r#"{"prompt": "Permission is hereby granted", "max_tokens": 12, "temperature": 0, "ignore_eos": true}"#;
        let mut conn = post(&server.addr, body);
        let mut reply = String::new();
        conn.read_to_string(&mut reply).unwrap();
        assert!(reply.starts_with("HTTP/1.1 200"), "--tp {tp}: {reply}");
        let json = &reply[reply.find("\r\n\r\n").unwrap() + 4..];
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        texts.push(v["choices"][0]["text"].as_str().unwrap().to_string());
        // SAFETY: kill sends a signal to the child this test started.
        assert_eq!(
            unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) },
            0
        );
        assert_eq!(server.child.wait().unwrap().code(), Some(0));
    }
    assert_eq!(texts[0], texts[1]);
}

/// Chat requests render in a child of the server's own binary: replaced or deleted on
/// disk (an upgrade or a rebuild in place), the server still renders them, and a
/// renderer that cannot start would be a 500, not a 400 blaming `messages`.
#[cfg(target_os = "linux")]
#[test]
fn chat_still_renders_after_the_binary_is_deleted() {
    let dir = std::env::temp_dir().join(format!("kiln-serve-exe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("kiln");
    std::fs::copy(env!("CARGO_BIN_EXE_kiln"), &exe).unwrap();
    let server = start_binary(&exe, &["--device", "cpu", "-t", "1"]);
    std::fs::remove_dir_all(&dir).unwrap();
    let body = r#"{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}"#;
    let mut conn = post_to(&server.addr, "/v1/chat/completions", body);
    let mut reply = String::new();
    conn.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
}

/// A template that fails for some messages fails those requests alone: one that raises
/// leaves its renderer rendering, one that runs out of the renderer's memory kills it and
/// the next chat gets a new one; the server answers throughout.
#[test]
fn a_chat_template_that_fails_fails_only_its_requests() {
    let dir = std::env::temp_dir().join(format!("kiln-serve-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let template = dir.join("t.jinja");
    std::fs::write(
        &template,
        "{% set m = messages[0].content %}{% if m == 'raise' %}{{ raise_exception('refused') }}\
         {% elif m == 'huge' %}{% set a = 'x' * 99999999 %}{% set b = a ~ a ~ a ~ a %}{{ (b ~ b ~ b) | length }}\
         {% endif %}user: {{ m }}\nassistant:",
    )
    .unwrap();
    let server = start(&[
        "--device",
        "cpu",
        "-t",
        "1",
        "--chat-template",
        template.to_str().unwrap(),
    ]);
    std::fs::remove_dir_all(&dir).unwrap();
    let chat = |content: &str| {
        let body = format!(
            r#"{{"messages": [{{"role": "user", "content": "{content}"}}], "max_tokens": 1}}"#
        );
        let mut conn = post_to(&server.addr, "/v1/chat/completions", &body);
        let mut reply = String::new();
        conn.read_to_string(&mut reply).unwrap();
        reply
    };
    for (content, status, says) in [
        ("Hi", "200", ""),
        ("raise", "400", "refused"),
        ("Hi", "200", ""),
        ("huge", "400", "MiB of memory"),
        ("Hi", "200", ""),
    ] {
        let reply = chat(content);
        assert!(
            reply.starts_with(&format!("HTTP/1.1 {status}")) && reply.contains(says),
            "{content}: {reply}"
        );
    }
}

/// A kept renderer killed from outside while idle costs no request: the next chat goes to
/// a new one.
#[cfg(target_os = "linux")]
#[test]
fn a_renderer_killed_while_idle_is_replaced() {
    let server = start(&["--device", "cpu", "-t", "1"]);
    let chat = || {
        let body = r#"{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}"#;
        let mut conn = post_to(&server.addr, "/v1/chat/completions", body);
        let mut reply = String::new();
        conn.read_to_string(&mut reply).unwrap();
        reply
    };
    let reply = chat();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    // The server's children (field 4 of /proc/PID/stat is the parent's pid).
    let parent = server.child.id().to_string();
    let children: Vec<i32> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                stat.rsplit_once(") ")
                    .and_then(|(_, rest)| rest.split(' ').nth(1).map(|p| p == parent))
                    .unwrap_or(false)
            })
        })
        .collect();
    assert!(!children.is_empty(), "no renderer kept");
    for pid in children {
        // SAFETY: kill sends a signal to a child of the server this test started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    std::thread::sleep(Duration::from_millis(100));
    for _ in 0..3 {
        let reply = chat();
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    }
}
