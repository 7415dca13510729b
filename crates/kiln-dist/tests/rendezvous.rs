//! The rendezvous with several processes on one machine, as several hosts would run it:
//! this test binary starts copies of itself as the other ranks (`rank_process`, which does
//! nothing unless the parent's environment says which rank it is).

use kiln_dist::rendezvous::{fetch, publish_on};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A rank of the parent's run: fetch, and print the payload or the error.
#[test]
fn rank_process() {
    let Ok(rank) = std::env::var("KILN_TEST_RANK") else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap();
    let got = fetch(
        &var("KILN_TEST_ADDR"),
        rank.parse().unwrap(),
        var("KILN_TEST_WORLD").parse().unwrap(),
        &var("KILN_TEST_FINGERPRINT"),
        Duration::from_secs(var("KILN_TEST_TIMEOUT").parse().unwrap()),
    );
    match got {
        Ok(p) => println!("PAYLOAD {}", String::from_utf8_lossy(&p)),
        Err(e) => println!("ERROR {e}"),
    }
}

fn spawn(addr: &str, rank: usize, world: usize, fingerprint: &str, timeout: u64) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "rank_process",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("KILN_TEST_RANK", rank.to_string())
        .env("KILN_TEST_ADDR", addr)
        .env("KILN_TEST_WORLD", world.to_string())
        .env("KILN_TEST_FINGERPRINT", fingerprint)
        .env("KILN_TEST_TIMEOUT", timeout.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// What a rank process printed: its `PAYLOAD …` or `ERROR …` line.
fn outcome(child: Child) -> String {
    let out = child.wait_with_output().unwrap();
    // The harness writes `test rank_process ... ` before the test's own line.
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    ["PAYLOAD ", "ERROR "]
        .iter()
        .filter_map(|k| text.find(k))
        .min()
        .map_or("(nothing)".into(), |at| {
            text[at..].lines().next().unwrap_or_default().to_string()
        })
}

fn listener() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (l, addr)
}

#[test]
fn every_rank_receives_rank_0s_payload() {
    let (l, addr) = listener();
    // The ranks start before rank 0 listens for them: they retry.
    let children: Vec<Child> = (1..4).map(|r| spawn(&addr, r, 4, "f00d", 30)).collect();
    std::thread::sleep(Duration::from_millis(300));
    publish_on(l, 4, "f00d", b"the-unique-id", Duration::from_secs(30)).unwrap();
    for (r, c) in children.into_iter().enumerate() {
        assert_eq!(outcome(c), "PAYLOAD the-unique-id", "rank {}", r + 1);
    }
}

#[test]
fn a_rank_with_another_model_ends_every_rank_naming_it() {
    let (l, addr) = listener();
    let children: Vec<Child> = (1..4)
        .map(|r| spawn(&addr, r, 4, if r == 2 { "beef" } else { "f00d" }, 5))
        .collect();
    let err = publish_on(l, 4, "f00d", b"id", Duration::from_secs(30))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank 2's model file or settings differ"),
        "{err}"
    );
    for c in children {
        let o = outcome(c);
        // Those that arrived were told why; one that had not yet can only time out.
        assert!(o.starts_with("ERROR "), "{o}");
    }
}

#[test]
fn a_rank_that_never_comes_ends_the_run_in_time() {
    let (l, addr) = listener();
    let child = spawn(&addr, 1, 3, "f00d", 30);
    let started = Instant::now();
    let err = publish_on(l, 3, "f00d", b"id", Duration::from_secs(2))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("[2]") && err.contains("did not arrive"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    let o = outcome(child);
    assert!(o.contains("refused") && o.contains("did not arrive"), "{o}");
}

#[test]
fn no_rank_0_is_an_error_after_the_deadline_not_a_hang() {
    let (l, addr) = listener();
    drop(l);
    let started = Instant::now();
    let err = fetch(&addr, 1, 2, "f00d", Duration::from_secs(1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("found no rank 0"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
}
