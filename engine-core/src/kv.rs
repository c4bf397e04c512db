//! The paged KV block manager.
//!
//! The KV cache is a pool of fixed-size blocks (default 16 tokens). A request's KV is a
//! *block table*: the list of blocks holding its positions in order, so position `p` lives in
//! `blocks[p / block_size]` at offset `p % block_size`:
//!
//! ```text
//!   request A: [ b7 | b2 | b9 ]      positions 0..15 -> b7, 16..31 -> b2, 32..  -> b9
//!   request B: [ b3 | b5 ]
//!   free list: b1 b4 b6 b8 ...       (b0 is the reserved scratch block)
//! ```
//!
//! O(1) allocate and free through a free list; each block has a reference count so that a
//! block can be shared (prefix caching builds on this). Block 0 is never handed out: it is the
//! scratch block that padding rows of a captured decode graph write into, so padding can never
//! touch a real request's KV.
//!
//! This manager is pure bookkeeping: it never touches memory.

use std::collections::VecDeque;

/// Index of a KV block in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// The scratch block, never allocated to a request.
pub const SCRATCH_BLOCK: BlockId = BlockId(0);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("out of KV blocks: {wanted} wanted, {free} free")]
pub struct OutOfBlocks {
    pub wanted: usize,
    pub free: usize,
}

#[derive(Debug, Clone)]
pub struct BlockManager {
    block_size: u32,
    free: VecDeque<BlockId>,
    ref_counts: Vec<u32>,
}

impl BlockManager {
    /// A pool of `num_blocks` blocks, one of which is the scratch block.
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        assert!(num_blocks >= 2, "need the scratch block plus at least one block");
        Self { block_size, free: (1..num_blocks).map(BlockId).collect(), ref_counts: vec![0; num_blocks as usize] }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Blocks that can be handed to requests (the scratch block excluded).
    pub fn num_usable(&self) -> u32 {
        self.ref_counts.len() as u32 - 1
    }

    pub fn num_free(&self) -> u32 {
        self.free.len() as u32
    }

    pub fn num_used(&self) -> u32 {
        self.num_usable() - self.num_free()
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: u32) -> u32 {
        num_tokens.div_ceil(self.block_size)
    }

    /// Appends `n` fresh blocks (ref count 1) to `table`; all or nothing.
    pub fn allocate(&mut self, n: u32, table: &mut Vec<BlockId>) -> Result<(), OutOfBlocks> {
        if n as usize > self.free.len() {
            return Err(OutOfBlocks { wanted: n as usize, free: self.free.len() });
        }
        for _ in 0..n {
            let block = self.free.pop_front().expect("checked above");
            debug_assert_eq!(self.ref_counts[block.0 as usize], 0, "free block with references");
            self.ref_counts[block.0 as usize] = 1;
            table.push(block);
        }
        Ok(())
    }

    /// Drops one reference to each block of `table` (in reverse, so a request's tail blocks go
    /// back to the free list first) and empties it.
    pub fn free(&mut self, table: &mut Vec<BlockId>) {
        for block in table.drain(..).rev() {
            let count = &mut self.ref_counts[block.0 as usize];
            assert!(*count > 0, "double free of {block:?}");
            *count -= 1;
            if *count == 0 {
                self.free.push_back(block);
            }
        }
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts[block.0 as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn scratch_block_is_never_allocated() {
        let mut kv = BlockManager::new(4, 16);
        let mut t = Vec::new();
        kv.allocate(3, &mut t).unwrap();
        assert!(!t.contains(&SCRATCH_BLOCK));
        assert_eq!(kv.allocate(1, &mut t), Err(OutOfBlocks { wanted: 1, free: 0 }));
        assert_eq!(t.len(), 3, "failed allocation leaves the table alone");
    }

    #[test]
    fn blocks_for_rounds_up() {
        let kv = BlockManager::new(4, 16);
        assert_eq!(kv.blocks_for(0), 0);
        assert_eq!(kv.blocks_for(1), 1);
        assert_eq!(kv.blocks_for(16), 1);
        assert_eq!(kv.blocks_for(17), 2);
    }

    proptest! {
        /// Any sequence of allocations and frees conserves blocks and never double-books one.
        #[test]
        fn no_leak_no_double_booking(ops in proptest::collection::vec((0usize..6, 0u32..5, any::<bool>()), 1..200)) {
            let mut kv = BlockManager::new(33, 16);
            let mut tables: Vec<Vec<BlockId>> = vec![Vec::new(); 6];
            for (t, n, free) in ops {
                if free {
                    kv.free(&mut tables[t]);
                } else {
                    let before = tables[t].len();
                    match kv.allocate(n, &mut tables[t]) {
                        Ok(()) => prop_assert_eq!(tables[t].len(), before + n as usize),
                        Err(_) => prop_assert_eq!(tables[t].len(), before),
                    }
                }
                let held: usize = tables.iter().map(Vec::len).sum();
                prop_assert_eq!(held as u32 + kv.num_free(), kv.num_usable());
                let mut all: Vec<BlockId> = tables.iter().flatten().copied().collect();
                all.sort();
                all.dedup();
                prop_assert_eq!(all.len(), held);
            }
            for t in &mut tables {
                kv.free(t);
            }
            prop_assert_eq!(kv.num_free(), kv.num_usable());
        }
    }
}
