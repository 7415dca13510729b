//! The CPU backend's threads: the calling thread works as member 0 of every parallel
//! loop, and between loops the other members spin for a while before they sleep.
//!
//! Why not rayon: a decode step is ~200 short parallel loops. Under rayon each one handed
//! its job from the model's thread to the pool and put that thread to sleep, and workers
//! with nothing to steal soon slept too: ~700 context switches per token on the 2-core
//! machine. On a virtual machine a sleeping vCPU halts and the host gives its core away,
//! so in busy hours every wake-up waited on the host: kiln's decode fell to a third
//! while llama.cpp, whose threads poll between ops, held its speed. Here a loop costs an
//! atomic store to start and a spin to finish.
//!
//! A loop claims its tasks one at a time from a shared counter, so a member that the OS
//! preempts holds up only the task it was on, and a member that arrives after every task
//! was claimed does not join at all: the loop ends when its claimed tasks are done.

use std::any::Any;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kiln_core::{Error, Result};

/// How long an idle worker polls for the next loop before it sleeps: longer than the
/// gaps between the ops of a step and between the steps of a generation.
const POLL_BEFORE_SLEEP: Duration = Duration::from_millis(2);

/// How long a waiting thread spins before it also yields its core at each check, so that
/// a preempted member on an oversubscribed machine gets to run.
const SPIN_BEFORE_YIELD: Duration = Duration::from_micros(50);

pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One loop at a time: other threads that call in wait here.
    caller: Mutex<()>,
}

/// A loop's body as the members run it, its lifetime erased: the caller keeps it alive
/// until no member is inside it (see [`Pool::run`]).
type Body = *const (dyn Fn() + Sync + 'static);

struct Shared {
    /// `loop number << 1 | open`: workers wait for it to change, and join a loop while
    /// its open bit is set.
    state: AtomicU64,
    /// The open loop's body; written only while the loop is closed, when no worker reads
    /// it.
    body: std::cell::UnsafeCell<Option<Body>>,
    /// Workers inside the current loop's body.
    inside: AtomicUsize,
    /// The next unclaimed task of the current loop, and the number of tasks.
    next: AtomicUsize,
    count: AtomicUsize,
    /// The first panic of a worker's task in this loop, for the caller to resume.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Workers asleep, and where they sleep.
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
}

// SAFETY: `body` is written by the calling thread only while the loop is closed and every
// worker that joined the previous loop has left it (`inside == 0`, ordered by the SeqCst
// `state`/`inside` accesses), and read by workers only between joining an open loop and
// leaving it; the body it points to is `Sync`.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

thread_local! {
    /// This thread is running a task of some pool's loop: a nested loop runs inline.
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

impl Pool {
    /// A pool of `threads` members (at least 1): the caller and `threads − 1` workers.
    pub fn new(threads: usize) -> Result<Self> {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            body: std::cell::UnsafeCell::new(None),
            inside: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            count: AtomicUsize::new(0),
            panic: Mutex::new(None),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let mut pool = Pool {
            shared,
            workers: Vec::new(),
            caller: Mutex::new(()),
        };
        for i in 1..threads.max(1) {
            let shared = pool.shared.clone();
            // On an error `pool` drops, which stops the workers already started.
            let worker = std::thread::Builder::new()
                .name(format!("kiln-cpu-{i}"))
                .spawn(move || work(&shared))
                .map_err(|e| Error::Device(format!("cannot start CPU thread {i}: {e}")))?;
            pool.workers.push(worker);
        }
        Ok(pool)
    }

    /// Members, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// `task(state, i)` for every `i` in `0..count`, each once, spread over the members;
    /// `init` makes the state (scratch buffers) once for each member that takes a task.
    pub fn for_each_init<S>(
        &self,
        count: usize,
        init: impl Fn() -> S + Sync,
        task: impl Fn(&mut S, usize) + Sync,
    ) {
        if count == 0 {
            return;
        }
        if count == 1 || self.workers.is_empty() || IN_TASK.get() {
            let mut state = init();
            (0..count).for_each(|i| task(&mut state, i));
            return;
        }
        let shared = &*self.shared;
        let body = || {
            let mut state = None;
            loop {
                let i = shared.next.fetch_add(1, SeqCst);
                if i >= shared.count.load(SeqCst) {
                    break;
                }
                task(state.get_or_insert_with(&init), i);
            }
        };
        self.run(count, &body);
    }

    /// `task(i, chunk)` for each chunk `i` of `size` elements of `data` (the last may be
    /// shorter), spread over the members.
    pub fn for_chunks_mut<T: Send>(
        &self,
        data: &mut [T],
        size: usize,
        task: impl Fn(usize, &mut [T]) + Sync,
    ) {
        self.for_chunks_mut_init(data, size, || (), |(), i, chunk| task(i, chunk));
    }

    /// Like [`Pool::for_chunks_mut`], with a state per member as in
    /// [`Pool::for_each_init`].
    pub fn for_chunks_mut_init<T: Send, S>(
        &self,
        data: &mut [T],
        size: usize,
        init: impl Fn() -> S + Sync,
        task: impl Fn(&mut S, usize, &mut [T]) + Sync,
    ) {
        let size = size.max(1);
        let len = data.len();
        let base = SharedMut::new(data);
        self.for_each_init(len.div_ceil(size), init, |state, i| {
            let start = i * size;
            // SAFETY: each `i` is claimed once, so the chunks handed out are disjoint parts
            // of `data`, which is borrowed mutably for the whole loop.
            let chunk =
                unsafe { std::slice::from_raw_parts_mut(base.at(start), size.min(len - start)) };
            task(state, i, chunk);
        });
    }

    /// Open a loop of `count` tasks running `body` on every member, run it here too, and
    /// return once every member that joined has left it. A task's panic is resumed here
    /// after that.
    fn run(&self, count: usize, body: &(dyn Fn() + Sync)) {
        let _one_loop = self.caller.lock().unwrap_or_else(|e| e.into_inner());
        let shared = &*self.shared;
        // SAFETY: the loop is closed and `inside == 0` (the previous `run` waited for it),
        // so no worker reads `body`; the erased lifetime ends before `run` returns, when
        // `close` has waited for every worker to leave.
        unsafe {
            *shared.body.get() = Some(std::mem::transmute::<*const (dyn Fn() + Sync + '_), Body>(
                body,
            ));
        }
        shared.next.store(0, SeqCst);
        shared.count.store(count, SeqCst);
        let number = (shared.state.load(SeqCst) >> 1) + 1;
        // Made before the loop opens: from here on, leaving this function in any way
        // first closes the loop and waits for the workers inside it.
        let close = Close { shared, number };
        shared.state.store(number << 1 | 1, SeqCst);
        if shared.sleepers.load(SeqCst) > 0 {
            let _lock = shared.sleep.lock().unwrap_or_else(|e| e.into_inner());
            shared.wake.notify_all();
        }
        let mine = run_body(shared, body);
        drop(close);
        let theirs = shared
            .panic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(payload) = mine.err().or(theirs) {
            std::panic::resume_unwind(payload);
        }
    }
}

/// Run a loop's body as this thread's share. On a panic the other members stop taking
/// tasks.
fn run_body(shared: &Shared, body: &(dyn Fn() + Sync)) -> std::thread::Result<()> {
    IN_TASK.set(true);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
    IN_TASK.set(false);
    if result.is_err() {
        shared.next.store(usize::MAX / 2, SeqCst);
    }
    result
}

struct Close<'a> {
    shared: &'a Shared,
    number: u64,
}

impl Drop for Close<'_> {
    fn drop(&mut self) {
        let s = self.shared;
        // No worker joins after this store; those already inside finish their tasks.
        s.state.store(self.number << 1, SeqCst);
        wait_until(|| s.inside.load(SeqCst) == 0);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        let number = (self.shared.state.load(SeqCst) >> 1) + 1;
        self.shared.state.store(number << 1, SeqCst);
        {
            let _lock = self.shared.sleep.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// A worker: wait for each loop, join it while it is open, leave when the pool drops.
fn work(s: &Shared) {
    // The state the pool started in, not the current one: a worker that starts late must
    // still see the loops (and the stop) that came before it.
    let mut seen = 0;
    loop {
        seen = next_state(s, seen);
        if s.stop.load(SeqCst) {
            return;
        }
        if seen & 1 == 0 {
            continue;
        }
        s.inside.fetch_add(1, SeqCst);
        // Re-read after announcing ourselves: either the caller's close comes later and
        // waits for us, or we see it and stay out (both accesses are SeqCst).
        if s.state.load(SeqCst) == seen {
            // SAFETY: the loop is open and we are counted in `inside`, so the caller keeps
            // `body` alive and unchanged until we leave.
            let body = unsafe { &*(*s.body.get()).expect("an open loop has a body") };
            if let Err(payload) = run_body(s, body) {
                // Kept for the caller to resume. A later one is leaked, not dropped here:
                // a payload whose drop panicked would end this worker while it is counted
                // inside the loop.
                let mut first = s.panic.lock().unwrap_or_else(|e| e.into_inner());
                if first.is_none() {
                    *first = Some(payload);
                } else {
                    std::mem::forget(payload);
                }
            }
        }
        s.inside.fetch_sub(1, SeqCst);
    }
}

/// Wait for `state` to move on from `seen`: poll, then sleep. Returns the new state.
fn next_state(s: &Shared, seen: u64) -> u64 {
    let mut poll = Poll::new();
    loop {
        let now = s.state.load(SeqCst);
        if now != seen {
            return now;
        }
        if poll.pause() < POLL_BEFORE_SLEEP {
            continue;
        }
        let mut lock = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
        s.sleepers.fetch_add(1, SeqCst);
        // Checked after counting ourselves in: a caller that stored a new state before our
        // count is seen here; one that stored it after sees the count and wakes us.
        while s.state.load(SeqCst) == seen && !s.stop.load(SeqCst) {
            lock = s.wake.wait(lock).unwrap_or_else(|e| e.into_inner());
        }
        s.sleepers.fetch_sub(1, SeqCst);
        return s.state.load(SeqCst);
    }
}

/// Poll until `done()`.
fn wait_until(done: impl Fn() -> bool) {
    let mut poll = Poll::new();
    while !done() {
        poll.pause();
    }
}

/// The pauses between the checks of a polling wait: a spin, and after
/// [`SPIN_BEFORE_YIELD`] a yield of the core as well.
struct Poll {
    start: Instant,
    checks: u32,
    waited: Duration,
}

impl Poll {
    fn new() -> Self {
        Poll {
            start: Instant::now(),
            checks: 0,
            waited: Duration::ZERO,
        }
    }

    /// Pause once; returns how long the wait has lasted (read from the clock every 64
    /// checks, which costs more than a check).
    fn pause(&mut self) -> Duration {
        // Wrapping: a wait may outlast 2^32 checks, and this runs where a panic must not
        // (closing a loop).
        self.checks = self.checks.wrapping_add(1);
        if self.checks.is_multiple_of(64) {
            self.waited = self.start.elapsed();
        }
        if self.waited > SPIN_BEFORE_YIELD && self.checks.is_multiple_of(64) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
        self.waited
    }
}

/// A mutable slice's base pointer, shared by the tasks of a loop that each write their own
/// elements of it (chunks, or column ranges of a matrix).
pub(crate) struct SharedMut<T>(*mut T);

// Not derived: the derive would ask `T: Copy`.
impl<T> Clone for SharedMut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedMut<T> {}

// SAFETY: users write disjoint elements from each task, while the slice is borrowed
// mutably for the loop; the elements may move between threads.
unsafe impl<T: Send> Send for SharedMut<T> {}
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub(crate) fn new(data: &mut [T]) -> Self {
        SharedMut(data.as_mut_ptr())
    }

    /// # Safety
    /// `offset`, and every element then reached from the pointer, must lie inside the
    /// slice, which must outlive those accesses; no other task may touch those elements.
    pub(crate) unsafe fn at(self, offset: usize) -> *mut T {
        // SAFETY: the caller keeps `offset` inside the slice.
        unsafe { self.0.add(offset) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// `task(i)` for every `i` in `0..count`.
    fn for_each(pool: &Pool, count: usize, task: impl Fn(usize) + Sync) {
        pool.for_each_init(count, || (), |(), i| task(i));
    }

    #[test]
    fn every_task_runs_once_on_every_pool_size() {
        for threads in [1, 2, 3, 5] {
            let pool = Pool::new(threads).unwrap();
            assert_eq!(pool.threads(), threads);
            for count in [0, 1, 2, 7, 1000] {
                let hits: Vec<AtomicU32> = (0..count).map(|_| AtomicU32::new(0)).collect();
                for_each(&pool, count, |i| {
                    hits[i].fetch_add(1, SeqCst);
                });
                assert!(
                    hits.iter().all(|h| h.load(SeqCst) == 1),
                    "{threads} threads, {count} tasks"
                );
            }
        }
    }

    #[test]
    fn chunks_cover_the_slice_once() {
        let pool = Pool::new(3).unwrap();
        for (len, size) in [(0, 4), (10, 3), (64, 64), (1000, 7)] {
            let mut data = vec![0u32; len];
            pool.for_chunks_mut(&mut data, size, |i, chunk| {
                assert!(chunk.len() <= size);
                for (j, v) in chunk.iter_mut().enumerate() {
                    *v += (i * size + j) as u32 + 1;
                }
            });
            assert!(
                data.iter().enumerate().all(|(j, &v)| v == j as u32 + 1),
                "len {len}, chunks of {size}"
            );
        }
    }

    #[test]
    fn state_is_made_once_per_member_at_most() {
        let pool = Pool::new(2).unwrap();
        let made = AtomicU32::new(0);
        let sum = AtomicU32::new(0);
        pool.for_each_init(
            100,
            || {
                made.fetch_add(1, SeqCst);
                0u32
            },
            |_, i| {
                sum.fetch_add(i as u32, SeqCst);
            },
        );
        assert!((1..=2).contains(&made.load(SeqCst)));
        assert_eq!(sum.load(SeqCst), 4950);
    }

    #[test]
    fn nested_loops_run_inline_and_loops_follow_a_sleep() {
        let pool = Pool::new(2).unwrap();
        let (total, elsewhere) = (AtomicU32::new(0), AtomicU32::new(0));
        for_each(&pool, 4, |_| {
            let outer = std::thread::current().id();
            for_each(&pool, 3, |_| {
                total.fetch_add(1, SeqCst);
                if std::thread::current().id() != outer {
                    elsewhere.fetch_add(1, SeqCst);
                }
            })
        });
        assert_eq!(total.load(SeqCst), 12);
        assert_eq!(elsewhere.load(SeqCst), 0, "nested tasks left their thread");
        // The idle worker goes to sleep, and the next loop wakes it.
        let sleepers = |n| {
            let start = Instant::now();
            while pool.shared.sleepers.load(SeqCst) != n {
                assert!(start.elapsed() < Duration::from_secs(5), "never {n} asleep");
                std::thread::sleep(POLL_BEFORE_SLEEP);
            }
        };
        sleepers(1);
        // Each of the two tasks waits for the other to start: only a worker that woke
        // up can take the second.
        let arrived = AtomicU32::new(0);
        for_each(&pool, 2, |_| {
            arrived.fetch_add(1, SeqCst);
            let start = Instant::now();
            while arrived.load(SeqCst) < 2 {
                assert!(
                    start.elapsed() < Duration::from_secs(5),
                    "the worker never woke"
                );
                std::thread::yield_now();
            }
        });
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_pool_still_works() {
        let pool = Pool::new(2).unwrap();
        let caller = std::thread::current().id();
        for on_worker in [true, false] {
            // Both tasks wait for each other, so each member takes one; the one on the
            // chosen side panics.
            let arrived = AtomicU32::new(0);
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                for_each(&pool, 2, |_| {
                    arrived.fetch_add(1, SeqCst);
                    let start = Instant::now();
                    while arrived.load(SeqCst) < 2 && start.elapsed() < Duration::from_secs(5) {
                        std::thread::yield_now();
                    }
                    if (std::thread::current().id() != caller) == on_worker {
                        std::panic::panic_any(format!("task on the worker: {on_worker}"));
                    }
                });
            }));
            let payload = caught.expect_err("the panic reaches the caller");
            assert_eq!(
                payload.downcast_ref::<String>().map(String::as_str),
                Some(format!("task on the worker: {on_worker}").as_str())
            );
        }
        let n = AtomicU32::new(0);
        for_each(&pool, 10, |_| {
            n.fetch_add(1, SeqCst);
        });
        assert_eq!(n.load(SeqCst), 10);
    }

    #[test]
    fn two_callers_share_one_pool() {
        let pool = Pool::new(2).unwrap();
        let n = AtomicU32::new(0);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    for _ in 0..200 {
                        for_each(&pool, 5, |_| {
                            n.fetch_add(1, SeqCst);
                        });
                    }
                });
            }
        });
        assert_eq!(n.load(SeqCst), 2000);
    }
}
