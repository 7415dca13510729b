//! KV memory in fixed-size blocks of positions, from a pool sized once at start and never
//! grown, with a prefix cache over whole blocks.
//!
//! A block id is a place in device memory: block `b` is rows `b · BLOCK_POSITIONS..` of
//! every layer's key and value pool (see `runner.rs`), and a sequence's block table is
//! what the paged attention reads.
//!
//! **Prefix caching.** Once a block's positions are all computed, the block is registered
//! under a hash of its tokens and of the blocks before it (so a block stands for its whole
//! prefix). A new sequence whose prompt starts with registered blocks takes them into its
//! table (a reference each) and computes only the rest: a shared system prompt is computed
//! once. A block whose last reference goes stays cached, evictable, until the pool needs
//! it: free blocks go first, then the least recently released cached ones. A sequence
//! never writes into a block it did not compute: at most the prompt's whole blocks before
//! its last token are taken from the cache, so at least one token is computed (its logits
//! are the first generated token's).

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

/// Positions per block (vLLM's and llama.cpp's default).
pub const BLOCK_POSITIONS: usize = 16;

/// Blocks needed to hold `positions` positions.
pub fn blocks_for(positions: usize) -> usize {
    positions.div_ceil(BLOCK_POSITIONS)
}

pub type BlockId = u32;

/// A registered block: the hash it is found by, and its tokens (checked on a match, so
/// that a hash collision can never hand a sequence another prompt's keys).
#[derive(Debug)]
struct Cached {
    hash: u64,
    parent: u64,
    tokens: [u32; BLOCK_POSITIONS],
}

/// The pool of blocks.
#[derive(Debug)]
pub struct BlockPool {
    /// Unreferenced blocks that hold nothing worth keeping.
    free: Vec<BlockId>,
    total: usize,
    /// References per block (sequences whose tables hold it).
    refs: Vec<u32>,
    /// What each registered block holds.
    content: Vec<Option<Cached>>,
    /// Registered blocks by hash.
    by_hash: HashMap<u64, BlockId>,
    /// Unreferenced registered blocks by when their last reference went (oldest first):
    /// what the pool evicts when nothing is free.
    evictable: BTreeMap<u64, BlockId>,
    /// Each evictable block's key in `evictable`.
    released_at: Vec<u64>,
    clock: u64,
}

impl BlockPool {
    pub fn new(total: usize) -> Self {
        // Popped from the end: the lowest ids go first, which reads well in logs and tests.
        let free = (0..total as BlockId).rev().collect();
        BlockPool {
            free,
            total,
            refs: vec![0; total],
            content: (0..total).map(|_| None).collect(),
            by_hash: HashMap::new(),
            evictable: BTreeMap::new(),
            released_at: vec![0; total],
            clock: 0,
        }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// Blocks a reservation can take: free ones and evictable cached ones.
    pub fn free(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks held by sequences.
    pub fn used(&self) -> usize {
        self.total - self.free()
    }

    /// Blocks kept for the prefix cache and held by no sequence.
    pub fn cached_idle(&self) -> usize {
        self.evictable.len()
    }

    /// Grow `table` to hold `positions` positions; false (and `table` unchanged) when the
    /// pool has too few blocks it can give.
    pub fn reserve(&mut self, table: &mut BlockTable, positions: usize) -> bool {
        let need = blocks_for(positions).saturating_sub(table.blocks.len());
        if need > self.free() {
            return false;
        }
        for _ in 0..need {
            let b = match self.free.pop() {
                Some(b) => b,
                None => self.evict_oldest(),
            };
            self.refs[b as usize] = 1;
            table.blocks.push(b);
        }
        true
    }

    /// The least recently released cached block, unregistered.
    fn evict_oldest(&mut self) -> BlockId {
        let (_, b) = self
            .evictable
            .pop_first()
            .expect("reserve counted the evictable blocks");
        if let Some(c) = self.content[b as usize].take() {
            self.by_hash.remove(&c.hash);
        }
        b
    }

    /// Return every block of `table` to the pool: registered ones stay cached.
    pub fn release(&mut self, table: &mut BlockTable) {
        for b in table.blocks.drain(..) {
            let i = b as usize;
            self.refs[i] -= 1;
            if self.refs[i] > 0 {
                continue;
            }
            if self.content[i].is_some() {
                self.clock += 1;
                self.released_at[i] = self.clock;
                self.evictable.insert(self.clock, b);
            } else {
                self.free.push(b);
            }
        }
        table.registered = 0;
        table.chain = 0;
    }

    /// Take the cached blocks that `tokens` starts with into the empty `table`, at most
    /// the whole blocks before its last token; returns the positions they hold.
    pub fn take_prefix(&mut self, table: &mut BlockTable, tokens: &[u32]) -> usize {
        debug_assert!(table.blocks.is_empty());
        let most = tokens.len().saturating_sub(1) / BLOCK_POSITIONS;
        for piece in tokens.chunks_exact(BLOCK_POSITIONS).take(most) {
            let hash = block_hash(table.chain, piece);
            let Some(&b) = self.by_hash.get(&hash) else {
                break;
            };
            let c = self.content[b as usize]
                .as_ref()
                .expect("a hashed block is registered");
            if c.parent != table.chain || c.tokens[..] != *piece {
                break;
            }
            let i = b as usize;
            if self.refs[i] == 0 {
                self.evictable.remove(&self.released_at[i]);
            }
            self.refs[i] += 1;
            table.blocks.push(b);
            table.registered += 1;
            table.chain = hash;
        }
        table.registered * BLOCK_POSITIONS
    }

    /// The hashes the blocks of `table` that positions up to `end` of `tokens` fill will be
    /// registered under (those not registered yet): what a step computing them makes.
    pub fn hashes_filled(&self, table: &BlockTable, tokens: &[u32], end: usize) -> Vec<u64> {
        let full = end.min(tokens.len()) / BLOCK_POSITIONS;
        let mut chain = table.chain;
        (table.registered..full)
            .map(|i| {
                chain = block_hash(chain, &tokens[i * BLOCK_POSITIONS..][..BLOCK_POSITIONS]);
                chain
            })
            .collect()
    }

    /// The hash of the first block of `tokens` past `table`'s registered ones that a new
    /// sequence could take from the cache (a whole block before the last token), if any.
    pub fn next_prefix_hash(&self, table: &BlockTable, tokens: &[u32]) -> Option<u64> {
        let i = table.registered;
        let most = tokens.len().saturating_sub(1) / BLOCK_POSITIONS;
        (i < most).then(|| {
            block_hash(
                table.chain,
                &tokens[i * BLOCK_POSITIONS..][..BLOCK_POSITIONS],
            )
        })
    }

    /// Register the blocks of `table` that `computed` positions of `tokens` have filled,
    /// so that later sequences can take them. A block whose content another block already
    /// holds stays unregistered (it is freed with its sequence).
    pub fn register(&mut self, table: &mut BlockTable, tokens: &[u32], computed: usize) {
        let full = (computed.min(tokens.len()) / BLOCK_POSITIONS).min(table.blocks.len());
        while table.registered < full {
            let i = table.registered;
            let piece = &tokens[i * BLOCK_POSITIONS..][..BLOCK_POSITIONS];
            let hash = block_hash(table.chain, piece);
            let b = table.blocks[i];
            if !self.by_hash.contains_key(&hash) && self.content[b as usize].is_none() {
                self.by_hash.insert(hash, b);
                self.content[b as usize] = Some(Cached {
                    hash,
                    parent: table.chain,
                    tokens: piece.try_into().expect("a whole block"),
                });
            }
            table.registered += 1;
            table.chain = hash;
        }
    }
}

/// The hash a block is registered under: its tokens and the hash of the blocks before it.
fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// The blocks one sequence holds, in the order of its positions.
#[derive(Debug, Default)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
    /// Leading blocks registered (or found already registered) in the prefix cache.
    registered: usize,
    /// The hash of the last of them (0 before the first).
    chain: u64,
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

    /// The block ids, in the order of the positions they hold.
    pub fn ids(&self) -> &[BlockId] {
        &self.blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every block is free, cached-idle or held, exactly once.
    fn assert_accounted(pool: &BlockPool, tables: &[&BlockTable]) {
        let mut seen = vec![0u32; pool.total];
        for &b in pool.free.iter().chain(pool.evictable.values()) {
            seen[b as usize] += 1;
        }
        for t in tables {
            for &b in &t.blocks {
                assert!(pool.refs[b as usize] > 0);
            }
        }
        for (b, &n) in seen.iter().enumerate() {
            let held = pool.refs[b] > 0;
            assert_eq!(
                n + u32::from(held),
                1,
                "block {b}: listed {n} times, held {held}"
            );
        }
    }

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
        assert_accounted(&pool, &[]);
    }

    fn tokens(first: u32, n: usize) -> Vec<u32> {
        (first..first + n as u32).collect()
    }

    #[test]
    fn a_shared_prefix_is_taken_from_the_cache_and_kept_until_evicted() {
        let mut pool = BlockPool::new(6);
        // A prompt of two whole blocks and a bit, computed and registered.
        let prompt = tokens(100, 2 * BLOCK_POSITIONS + 3);
        let mut a = BlockTable::default();
        assert_eq!(pool.take_prefix(&mut a, &prompt), 0);
        assert!(pool.reserve(&mut a, prompt.len()));
        pool.register(&mut a, &prompt, prompt.len());
        // Another prompt with the same two blocks and another tail takes both.
        let mut other = prompt[..2 * BLOCK_POSITIONS].to_vec();
        other.extend([7, 8, 9, 10]);
        let mut b = BlockTable::default();
        assert_eq!(pool.take_prefix(&mut b, &other), 2 * BLOCK_POSITIONS);
        assert_eq!(b.ids(), &a.ids()[..2]);
        assert!(pool.reserve(&mut b, other.len()));
        assert_ne!(b.ids()[2], a.ids()[2]);
        assert_eq!(pool.used(), 4);
        assert_accounted(&pool, &[&a, &b]);
        // A prompt that is exactly the two blocks takes only the first: its last token
        // must be computed, in a block of its own.
        let mut c = BlockTable::default();
        assert_eq!(
            pool.take_prefix(&mut c, &prompt[..2 * BLOCK_POSITIONS]),
            BLOCK_POSITIONS
        );
        // Another first block: nothing matches (the chain starts differently).
        let mut d = BlockTable::default();
        let mut shifted = prompt.clone();
        shifted[0] = 1;
        assert_eq!(pool.take_prefix(&mut d, &shifted), 0);
        pool.release(&mut c);
        // Released, the registered blocks stay cached and can be taken again.
        pool.release(&mut a);
        pool.release(&mut b);
        assert_eq!((pool.used(), pool.cached_idle()), (0, 2));
        assert_accounted(&pool, &[]);
        let mut e = BlockTable::default();
        assert_eq!(pool.take_prefix(&mut e, &other), 2 * BLOCK_POSITIONS);
        pool.release(&mut e);
        // When the pool needs every block, the cached ones are evicted, oldest first.
        let mut big = BlockTable::default();
        assert!(pool.reserve(&mut big, 6 * BLOCK_POSITIONS));
        assert_eq!(pool.cached_idle(), 0);
        pool.release(&mut big);
        let mut f = BlockTable::default();
        assert_eq!(pool.take_prefix(&mut f, &other), 0);
        assert_accounted(&pool, &[]);
    }

    #[test]
    fn a_block_computed_twice_is_registered_once_and_the_copy_freed() {
        let mut pool = BlockPool::new(4);
        let prompt = tokens(5, BLOCK_POSITIONS + 1);
        let (mut a, mut b) = (BlockTable::default(), BlockTable::default());
        // Both admitted before either registered: each computes the block.
        for t in [&mut a, &mut b] {
            assert_eq!(pool.take_prefix(t, &prompt), 0);
            assert!(pool.reserve(t, prompt.len()));
        }
        pool.register(&mut a, &prompt, prompt.len());
        pool.register(&mut b, &prompt, prompt.len());
        pool.release(&mut a);
        pool.release(&mut b);
        assert_eq!(pool.cached_idle(), 1);
        assert_eq!(pool.free.len(), 3);
        assert_accounted(&pool, &[]);
    }
}
