//! How the ranks of a run find each other before the collective library connects them:
//! rank 0 listens on `--master-addr` (host:port); every other rank connects (retrying
//! until the deadline: rank 0 may start later), says who it is and what it runs, and
//! receives rank 0's payload (NCCL's unique id). Rank 0 hands the payload out only once
//! every rank has arrived and each one's *fingerprint* (a digest of its model file and
//! run settings, made by the caller) equals its own: ranks that would compute different
//! things, or a rank that never comes, end every rank with one message naming the rank,
//! never a hang.
//!
//! The exchange is a few short lines of text over TCP, each side bounded in what it reads
//! and in time:
//!
//! ```text
//! rank → 0:  kiln-rendezvous 1 <rank> <world> <fingerprint>\n
//! 0 → rank:  ok <payload length>\n<payload bytes>     or     refused <why>\n
//! ```

use kiln_core::{Error, Result};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const HELLO: &str = "kiln-rendezvous 1";
/// Longest line either side reads; a fingerprint is a hex digest.
const MAX_LINE: u64 = 1024;
/// Largest payload (NCCL's unique id is 128 bytes).
const MAX_PAYLOAD: usize = 64 << 10;

/// What a rank says of itself.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Hello {
    rank: usize,
    world: usize,
    fingerprint: String,
}

fn protocol(what: impl std::fmt::Display) -> Error {
    Error::format(format!("rendezvous: {what}"))
}

/// One line, at most [`MAX_LINE`] bytes, without its newline.
fn read_line(r: &mut impl BufRead) -> std::io::Result<String> {
    let mut line = String::new();
    r.take(MAX_LINE).read_line(&mut line)?;
    if !line.ends_with('\n') {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "a line cut off or too long",
        ));
    }
    line.pop();
    Ok(line)
}

fn parse_hello(line: &str) -> Option<Hello> {
    let rest = line.strip_prefix(HELLO)?.strip_prefix(' ')?;
    let mut it = rest.splitn(3, ' ');
    let rank = it.next()?.parse().ok()?;
    let world = it.next()?.parse().ok()?;
    let fingerprint = it.next()?.to_string();
    Some(Hello {
        rank,
        world,
        fingerprint,
    })
}

/// Rank 0's side: listen on `addr` until the other `world - 1` ranks have arrived with
/// `fingerprint`, then give each `payload`. On any mismatch, a duplicate or missing rank
/// or the deadline passing, every rank that arrived is told why, and so is the caller.
pub fn publish(
    addr: &str,
    world: usize,
    fingerprint: &str,
    payload: &[u8],
    timeout: Duration,
) -> Result<()> {
    let listener = TcpListener::bind(resolve(addr)?)
        .map_err(|e| Error::io(format!("rendezvous: listening on {addr}"), e))?;
    publish_on(listener, world, fingerprint, payload, timeout)
}

/// [`publish`] on a listener the caller bound (a test's port 0).
pub fn publish_on(
    listener: TcpListener,
    world: usize,
    fingerprint: &str,
    payload: &[u8],
    timeout: Duration,
) -> Result<()> {
    if world == 0 || payload.len() > MAX_PAYLOAD || fingerprint.contains('\n') {
        return Err(protocol(format!(
            "world {world}, a payload of {} bytes",
            payload.len()
        )));
    }
    let deadline = Instant::now() + timeout;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("rendezvous", e))?;
    let mut arrived: Vec<(Hello, TcpStream)> = Vec::new();
    let mut problem: Option<String> = None;
    while arrived.len() + 1 < world && problem.is_none() {
        let now = Instant::now();
        if now >= deadline {
            let mut missing: Vec<usize> = (1..world)
                .filter(|r| !arrived.iter().any(|(h, _)| h.rank == *r))
                .collect();
            missing.truncate(16);
            problem = Some(format!(
                "rank(s) {missing:?} of {world} did not arrive within {} s",
                timeout.as_secs()
            ));
            break;
        }
        let (stream, peer) = match listener.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(Error::io("rendezvous: accepting", e)),
        };
        let _ = stream.set_nonblocking(false);
        // A connection that says nothing holds up the others for a few seconds at most.
        let wait = (deadline - now).clamp(Duration::from_millis(100), Duration::from_secs(5));
        let _ = stream.set_read_timeout(Some(wait));
        let mut reader = BufReader::new(&stream);
        let hello = match read_line(&mut reader).ok().and_then(|l| parse_hello(&l)) {
            Some(h) => h,
            // Not a rank of ours (a port scanner, a stale client): ignored.
            None => continue,
        };
        problem = if hello.world != world {
            Some(format!(
                "rank {} was started for {} ranks, rank 0 for {world}",
                hello.rank, hello.world
            ))
        } else if hello.rank == 0 || hello.rank >= world {
            Some(format!("a rank {} in a run of {world} ranks", hello.rank))
        } else if arrived.iter().any(|(h, _)| h.rank == hello.rank) {
            Some(format!("rank {} arrived twice (from {peer})", hello.rank))
        } else if hello.fingerprint != fingerprint {
            Some(format!(
                "rank {}'s model file or settings differ from rank 0's (fingerprint {} against {fingerprint}): start every rank with the same files and flags",
                hello.rank, hello.fingerprint
            ))
        } else {
            None
        };
        arrived.push((hello, stream));
    }
    if let Some(why) = problem {
        for (_, mut s) in arrived {
            let _ = writeln!(s, "refused {why}");
        }
        return Err(protocol(why));
    }
    for (hello, mut s) in arrived {
        let sent = writeln!(s, "ok {}", payload.len())
            .and_then(|()| s.write_all(payload))
            .and_then(|()| s.flush());
        if let Err(e) = sent {
            return Err(Error::io(
                format!("rendezvous: sending to rank {}", hello.rank),
                e,
            ));
        }
    }
    Ok(())
}

/// A rank's side (rank ≥ 1): connect to rank 0 at `addr` (retrying until the deadline),
/// say who it is, and receive the payload, or rank 0's reason for refusing the run.
pub fn fetch(
    addr: &str,
    rank: usize,
    world: usize,
    fingerprint: &str,
    timeout: Duration,
) -> Result<Vec<u8>> {
    if rank == 0 || rank >= world || fingerprint.contains('\n') {
        return Err(protocol(format!("rank {rank} of {world} fetches nothing")));
    }
    let target = resolve(addr)?;
    let deadline = Instant::now() + timeout;
    let stream = loop {
        match TcpStream::connect_timeout(&target, Duration::from_secs(1)) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => {
                return Err(Error::io(
                    format!(
                        "rendezvous: rank {rank} found no rank 0 at {addr} within {} s",
                        timeout.as_secs()
                    ),
                    e,
                ))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    let left = deadline.saturating_duration_since(Instant::now());
    let _ = stream.set_read_timeout(Some(left.max(Duration::from_millis(100))));
    let io = |e| Error::io(format!("rendezvous: rank {rank} with rank 0 at {addr}"), e);
    (&stream)
        .write_all(format!("{HELLO} {rank} {world} {fingerprint}\n").as_bytes())
        .map_err(io)?;
    let mut reader = BufReader::new(&stream);
    let line = read_line(&mut reader).map_err(io)?;
    if let Some(why) = line.strip_prefix("refused ") {
        return Err(protocol(format!("rank 0 refused the run: {why}")));
    }
    let len: usize = line
        .strip_prefix("ok ")
        .and_then(|n| n.parse().ok())
        .filter(|&n| n <= MAX_PAYLOAD)
        .ok_or_else(|| protocol(format!("rank 0 answered {line:?}")))?;
    let mut payload = vec![0u8; len];
    reader.read_exact(&mut payload).map_err(io)?;
    Ok(payload)
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::io(format!("rendezvous: --master-addr {addr}"), e))?
        .next()
        .ok_or_else(|| protocol(format!("--master-addr {addr} names no address")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellos_parse_and_bad_ones_do_not() {
        assert_eq!(
            parse_hello("kiln-rendezvous 1 3 4 ab12"),
            Some(Hello {
                rank: 3,
                world: 4,
                fingerprint: "ab12".into()
            })
        );
        for bad in [
            "",
            "GET / HTTP/1.1",
            "kiln-rendezvous 1 x 4 f",
            "kiln-rendezvous 2 1 2 f",
        ] {
            assert_eq!(parse_hello(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_line_past_the_limit_is_an_error() {
        let long = vec![b'a'; 2 * MAX_LINE as usize];
        assert!(read_line(&mut &long[..]).is_err());
        assert_eq!(read_line(&mut &b"short\nrest"[..]).unwrap(), "short");
    }
}
