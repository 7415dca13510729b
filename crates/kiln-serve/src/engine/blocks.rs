//! KV memory accounted in fixed-size blocks of positions, from a pool sized once at start
//! and never grown. Each sequence holds a block table: the blocks its positions occupy, in
//! order. Blocks come back to the pool the moment a sequence finishes, is cancelled or is
//! preempted.
//!
//! Today's runner keeps each sequence's keys and values in a contiguous cache of its own,
//! sized to the blocks it holds (see `runner.rs`), so a block id names a share of the
//! pool, not yet a place in device memory: the table is what a paged attention kernel will
//! read once one exists.

/// Positions per block (vLLM's and llama.cpp's default).
pub const BLOCK_POSITIONS: usize = 16;

/// Blocks needed to hold `positions` positions.
pub fn blocks_for(positions: usize) -> usize {
    positions.div_ceil(BLOCK_POSITIONS)
}

pub type BlockId = u32;

/// The pool of blocks: a free list over ids `0..total`.
#[derive(Debug)]
pub struct BlockPool {
    free: Vec<BlockId>,
    total: usize,
}

impl BlockPool {
    pub fn new(total: usize) -> Self {
        // Popped from the end: the lowest ids go first, which reads well in logs and tests.
        let free = (0..total as BlockId).rev().collect();
        BlockPool { free, total }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn free(&self) -> usize {
        self.free.len()
    }

    pub fn used(&self) -> usize {
        self.total - self.free.len()
    }

    /// Grow `table` to hold `positions` positions; false (and `table` unchanged) when the
    /// pool has too few free blocks.
    pub fn reserve(&mut self, table: &mut BlockTable, positions: usize) -> bool {
        let need = blocks_for(positions).saturating_sub(table.blocks.len());
        if need > self.free.len() {
            return false;
        }
        let at = self.free.len() - need;
        table.blocks.extend(self.free.drain(at..).rev());
        true
    }

    /// Return every block of `table` to the pool.
    pub fn release(&mut self, table: &mut BlockTable) {
        self.free.append(&mut table.blocks);
    }
}

/// The blocks one sequence holds, in the order of its positions.
#[derive(Debug, Default)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
}

impl BlockTable {
    /// Positions the table's blocks hold.
    pub fn capacity(&self) -> usize {
        self.blocks.len() * BLOCK_POSITIONS
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_is_all_or_nothing_and_release_returns_everything() {
        let mut pool = BlockPool::new(4);
        let (mut a, mut b) = (BlockTable::default(), BlockTable::default());
        assert!(pool.reserve(&mut a, 17));
        assert_eq!((a.len(), a.capacity(), pool.free()), (2, 32, 2));
        // Already held positions take nothing more.
        assert!(pool.reserve(&mut a, 32));
        assert_eq!(pool.used(), 2);
        assert!(!pool.reserve(&mut b, 3 * BLOCK_POSITIONS));
        assert!(b.is_empty());
        assert_eq!(pool.free(), 2);
        assert!(pool.reserve(&mut b, 2 * BLOCK_POSITIONS));
        assert_eq!(pool.free(), 0);
        assert!(!pool.reserve(&mut a, 33));
        pool.release(&mut a);
        pool.release(&mut b);
        assert_eq!((pool.free(), pool.used(), a.len()), (4, 0, 0));
        let mut ids = pool.free.clone();
        ids.sort();
        assert_eq!(ids, [0, 1, 2, 3], "no block lost or doubled");
    }
}
