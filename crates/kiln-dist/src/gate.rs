//! A barrier the threads of a group can break, so that none waits for ever on one that
//! stopped.

use kiln_core::{Error, Result};
use std::sync::{Condvar, Mutex};

/// A barrier that a rank can break: the ranks waiting at it, and those that come later,
/// get the reason instead of waiting for ever.
pub struct Gate {
    state: Mutex<GateState>,
    turned: Condvar,
    world: usize,
}

struct GateState {
    waiting: usize,
    generation: u64,
    broken: Option<String>,
}

impl Gate {
    pub fn new(world: usize) -> Gate {
        Gate {
            state: Mutex::new(GateState {
                waiting: 0,
                generation: 0,
                broken: None,
            }),
            turned: Condvar::new(),
            world,
        }
    }

    /// Wait for every rank; an error with the reason once the gate is broken.
    pub fn wait(&self) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = &st.broken {
            return Err(Error::Device(why.clone()));
        }
        st.waiting += 1;
        if st.waiting == self.world {
            st.waiting = 0;
            st.generation += 1;
            self.turned.notify_all();
            return Ok(());
        }
        let generation = st.generation;
        while st.generation == generation && st.broken.is_none() {
            st = self.turned.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        match (&st.broken, st.generation == generation) {
            (Some(why), true) => Err(Error::Device(why.clone())),
            _ => Ok(()),
        }
    }

    /// Break the gate for `why` (the first reason stays).
    pub fn break_with(&self, why: String) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.broken.get_or_insert(why);
        self.turned.notify_all();
    }

    /// Why the gate was broken, if it was.
    pub fn broken(&self) -> Option<String> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.broken.clone()
    }
}
