//! The paged KV block manager with prefix caching.
//!
//! The KV cache is a pool of fixed-size blocks (default 16 tokens). A request's KV is a
//! *block table*: the list of blocks holding its positions in order, so position `p` lives in
//! `blocks[p / block_size]` at offset `p % block_size`:
//!
//! ```text
//!   request A: [ b7 | b2 | b9 ]      positions 0..15 -> b7, 16..31 -> b2, 32..  -> b9
//!   request B: [ b7 | b5 ]           shares A's first block (same first 16 tokens): b7 ref 2
//!   free list: b1 b4 b6(#h) b8 ...   head evicted first; b6 still holds cached KV (hash h)
//! ```
//!
//! Prefix caching (reference 004 §3-4, vLLM v1's design): every *full* block whose KV is
//! computed gets a hash chained over its tokens and its parent block's hash (plus a per-request
//! salt), registered in a hash map. A new request walks its own chain of block hashes and
//! reuses the longest prefix of cached blocks; a hit is accepted only if the block's stored
//! token ids equal the request's (so a hash collision can never serve wrong KV). Blocks are
//! reference-counted; a block whose count drops to zero goes to the tail of the free list but
//! keeps its hash, so it can still be hit until allocation evicts it from the head (LRU; a
//! request's blocks are freed tail first, so the ends of sequences are evicted before shared
//! prefixes).
//!
//! All operations are O(1) per block: the free list is an intrusive doubly linked list over
//! block ids, so a hit on a free block unlinks it in place. Block 0 is never handed out: it
//! is the scratch block that padding rows of a captured decode graph write into.
//!
//! This manager is pure bookkeeping: it never touches KV memory.

use std::collections::HashMap;

/// Index of a KV block in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// The scratch block, never allocated to a request.
pub const SCRATCH_BLOCK: BlockId = BlockId(0);

/// Hash of a full block, chained over its prefix.
pub type BlockHash = u64;

/// Hashes one full block given its parent's hash (None for the first block) and a salt.
pub type HashFn = fn(parent: Option<BlockHash>, tokens: &[u32], salt: u64) -> BlockHash;

/// xxHash64 over (parent, salt, tokens), seeded.
pub fn xxhash_block(parent: Option<BlockHash>, tokens: &[u32], salt: u64) -> BlockHash {
    let mut h = xxhash_rust::xxh64::Xxh64::new(0x4841_5252_4945_5221); // "HARRIER!"
    match parent {
        Some(p) => {
            h.update(&[1]);
            h.update(&p.to_le_bytes());
        }
        None => h.update(&[0]),
    }
    h.update(&salt.to_le_bytes());
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    h.digest()
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("out of KV blocks: {wanted} wanted, {free} free")]
pub struct OutOfBlocks {
    pub wanted: usize,
    pub free: usize,
}

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Meta {
    ref_count: u32,
    /// Set while the block is registered in the prefix cache.
    hash: Option<BlockHash>,
    /// The block's token ids, kept for the collision check (only while hashed).
    tokens: Vec<u32>,
    prev: u32,
    next: u32,
    in_free_list: bool,
}

#[derive(Debug, Clone)]
pub struct BlockManager {
    block_size: u32,
    meta: Vec<Meta>,
    head: u32,
    tail: u32,
    num_free: u32,
    cache: HashMap<BlockHash, BlockId>,
    caching: bool,
    hash_fn: HashFn,
}

impl BlockManager {
    /// A pool of `num_blocks` blocks (one of which is the scratch block).
    pub fn new(num_blocks: u32, block_size: u32, caching: bool) -> Self {
        Self::with_hash(num_blocks, block_size, caching, xxhash_block)
    }

    /// As [`Self::new`] with another hash function (tests force collisions with it).
    pub fn with_hash(num_blocks: u32, block_size: u32, caching: bool, hash_fn: HashFn) -> Self {
        assert!(
            num_blocks >= 2,
            "need the scratch block plus at least one block"
        );
        let meta = (0..num_blocks)
            .map(|_| Meta {
                ref_count: 0,
                hash: None,
                tokens: Vec::new(),
                prev: NIL,
                next: NIL,
                in_free_list: false,
            })
            .collect();
        let mut m = Self {
            block_size,
            meta,
            head: NIL,
            tail: NIL,
            num_free: 0,
            cache: HashMap::new(),
            caching,
            hash_fn,
        };
        for b in 1..num_blocks {
            m.push_back(b);
        }
        m
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn caching(&self) -> bool {
        self.caching
    }

    pub fn hash_fn(&self) -> HashFn {
        self.hash_fn
    }

    /// Blocks that can be handed to requests (the scratch block excluded).
    pub fn num_usable(&self) -> u32 {
        self.meta.len() as u32 - 1
    }

    /// Blocks with no reference (cached ones included: they can be evicted at any time).
    pub fn num_free(&self) -> u32 {
        self.num_free
    }

    pub fn num_used(&self) -> u32 {
        self.num_usable() - self.num_free
    }

    /// Blocks registered in the prefix cache.
    pub fn num_cached(&self) -> usize {
        self.cache.len()
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: u32) -> u32 {
        num_tokens.div_ceil(self.block_size)
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.meta[block.0 as usize].ref_count
    }

    fn push_back(&mut self, b: u32) {
        let m = &mut self.meta[b as usize];
        debug_assert!(!m.in_free_list);
        m.in_free_list = true;
        m.prev = self.tail;
        m.next = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.meta[self.tail as usize].next = b;
        }
        self.tail = b;
        self.num_free += 1;
    }

    fn unlink(&mut self, b: u32) {
        let (prev, next) = {
            let m = &mut self.meta[b as usize];
            debug_assert!(m.in_free_list);
            m.in_free_list = false;
            (m.prev, m.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.meta[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.meta[next as usize].prev = prev;
        }
        self.num_free -= 1;
    }

    /// Drops `b` from the prefix cache.
    fn evict(&mut self, b: u32) {
        let m = &mut self.meta[b as usize];
        if let Some(h) = m.hash.take() {
            m.tokens.clear();
            if self.cache.get(&h) == Some(&BlockId(b)) {
                self.cache.remove(&h);
            }
        }
    }

    /// Appends `n` fresh blocks (ref count 1) to `table`, evicting cached blocks from the
    /// head of the free list; all or nothing.
    pub fn allocate(&mut self, n: u32, table: &mut Vec<BlockId>) -> Result<(), OutOfBlocks> {
        if n > self.num_free {
            return Err(OutOfBlocks {
                wanted: n as usize,
                free: self.num_free as usize,
            });
        }
        for _ in 0..n {
            let b = self.head;
            self.unlink(b);
            self.evict(b);
            let m = &mut self.meta[b as usize];
            debug_assert_eq!(m.ref_count, 0, "free block with references");
            m.ref_count = 1;
            table.push(BlockId(b));
        }
        Ok(())
    }

    /// Drops one reference to each block of `table` (tail first, so the ends of sequences are
    /// evicted before their prefixes) and empties it. Hashed blocks stay cached.
    pub fn free(&mut self, table: &mut Vec<BlockId>) {
        for block in table.drain(..).rev() {
            self.release(block);
        }
    }

    /// Drops one reference to `block` (a table entry that is given up alone: a sliding-window
    /// block no token can see any more). The scratch block is skipped: tables use it for such
    /// released entries.
    pub fn release(&mut self, block: BlockId) {
        if block == SCRATCH_BLOCK {
            return;
        }
        let m = &mut self.meta[block.0 as usize];
        assert!(m.ref_count > 0, "double free of {block:?}");
        m.ref_count -= 1;
        if m.ref_count == 0 {
            if !self.caching {
                self.evict(block.0);
            }
            self.push_back(block.0);
        }
    }

    /// How many of `blocks` only one table holds (what freeing them gives back; the scratch
    /// block, never allocated, counts 0).
    pub fn count_unshared(&self, blocks: &[BlockId]) -> u32 {
        blocks.iter().filter(|&&b| self.ref_count(b) == 1).count() as u32
    }

    /// The number of leading blocks of a sequence that are cached with exactly its tokens.
    /// `hashes[i]` is the chained hash of the sequence's block `i`; `same_tokens(i, stored)`
    /// says whether block `i` of the sequence holds exactly the `stored` token ids.
    pub fn lookup(&self, hashes: &[BlockHash], same_tokens: impl Fn(usize, &[u32]) -> bool) -> u32 {
        if !self.caching {
            return 0;
        }
        let mut n = 0;
        for (i, h) in hashes.iter().enumerate() {
            match self.cache.get(h) {
                Some(b) if same_tokens(i, &self.meta[b.0 as usize].tokens) => n += 1,
                _ => break,
            }
        }
        n
    }

    /// How many of these cached blocks are currently free (taking them uses free capacity).
    pub fn count_free_hits(&self, hashes: &[BlockHash]) -> u32 {
        hashes
            .iter()
            .filter(|h| {
                self.cache
                    .get(*h)
                    .is_some_and(|b| self.meta[b.0 as usize].ref_count == 0)
            })
            .count() as u32
    }

    /// Takes a reference to the cached blocks of `hashes` (all hits by [`Self::lookup`]).
    pub fn acquire_cached(&mut self, hashes: &[BlockHash], table: &mut Vec<BlockId>) {
        for h in hashes {
            let b = self.cache[h];
            if self.meta[b.0 as usize].ref_count == 0 {
                self.unlink(b.0);
            }
            self.meta[b.0 as usize].ref_count += 1;
            table.push(b);
        }
    }

    /// Registers a full, computed block under `hash` (no-op when caching is off, when the block
    /// is already registered, or when another block already holds that hash).
    pub fn register(&mut self, block: BlockId, hash: BlockHash, tokens: &[u32]) {
        if !self.caching || self.cache.contains_key(&hash) {
            return;
        }
        let m = &mut self.meta[block.0 as usize];
        debug_assert!(m.ref_count > 0, "registering an unreferenced block");
        if m.hash.is_some() {
            return;
        }
        m.hash = Some(hash);
        m.tokens.clear();
        m.tokens.extend_from_slice(tokens);
        self.cache.insert(hash, block);
    }

    /// Forgets every cached hash (blocks in use keep their KV; nothing new will hit it).
    pub fn reset_cache(&mut self) {
        self.cache.clear();
        for m in &mut self.meta {
            m.hash = None;
            m.tokens.clear();
        }
    }

    /// Debug check: the free list holds exactly the unreferenced blocks; counts agree.
    pub fn check(&self) {
        let mut n = 0;
        let mut b = self.head;
        let mut prev = NIL;
        while b != NIL {
            let m = &self.meta[b as usize];
            assert!(
                m.in_free_list && m.ref_count == 0,
                "block {b} in the free list with references"
            );
            assert_eq!(m.prev, prev);
            prev = b;
            b = m.next;
            n += 1;
        }
        assert_eq!(n, self.num_free, "free list length");
        let unreferenced = self
            .meta
            .iter()
            .skip(1)
            .filter(|m| m.ref_count == 0)
            .count() as u32;
        assert_eq!(
            unreferenced, self.num_free,
            "unreferenced blocks outside the free list"
        );
        for (h, b) in &self.cache {
            assert_eq!(
                self.meta[b.0 as usize].hash,
                Some(*h),
                "cache map out of sync"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn chain(tokens: &[u32], bs: usize, hash: HashFn) -> Vec<BlockHash> {
        let mut out: Vec<BlockHash> = Vec::new();
        for block in tokens.chunks_exact(bs) {
            out.push(hash(out.last().copied(), block, 0));
        }
        out
    }

    #[test]
    fn scratch_block_is_never_allocated() {
        let mut kv = BlockManager::new(4, 16, true);
        let mut t = Vec::new();
        kv.allocate(3, &mut t).unwrap();
        assert!(!t.contains(&SCRATCH_BLOCK));
        assert_eq!(
            kv.allocate(1, &mut t),
            Err(OutOfBlocks { wanted: 1, free: 0 })
        );
        assert_eq!(t.len(), 3, "failed allocation leaves the table alone");
    }

    #[test]
    fn blocks_for_rounds_up() {
        let kv = BlockManager::new(4, 16, true);
        assert_eq!([0, 1, 16, 17].map(|n| kv.blocks_for(n)), [0, 1, 1, 2]);
    }

    #[test]
    fn hashes_chain_over_the_prefix() {
        let a = xxhash_block(None, &[1, 2], 0);
        assert_ne!(
            xxhash_block(Some(a), &[3, 4], 0),
            xxhash_block(Some(a ^ 1), &[3, 4], 0),
            "parent matters"
        );
        assert_ne!(
            xxhash_block(None, &[1, 2], 0),
            xxhash_block(None, &[1, 2], 7),
            "salt matters"
        );
        assert_ne!(
            xxhash_block(None, &[1, 2], 0),
            xxhash_block(None, &[2, 1], 0),
            "order matters"
        );
        assert_eq!(
            xxhash_block(Some(a), &[3, 4], 0),
            xxhash_block(Some(a), &[3, 4], 0)
        );
    }

    #[test]
    fn shared_prefix_is_reused_with_ref_counts() {
        let mut kv = BlockManager::new(10, 2, true);
        let tokens = [1, 2, 3, 4, 5, 6];
        let hashes = chain(&tokens, 2, xxhash_block);
        let mut a = Vec::new();
        kv.allocate(3, &mut a).unwrap();
        for i in 0..3 {
            kv.register(a[i], hashes[i], &tokens[2 * i..2 * i + 2]);
        }
        // Same first two blocks, different third.
        let other = [1, 2, 3, 4, 9, 9];
        let oh = chain(&other, 2, xxhash_block);
        assert_eq!(kv.lookup(&oh, |i, s| s == &other[2 * i..2 * i + 2]), 2);
        let mut b = Vec::new();
        kv.acquire_cached(&oh[..2], &mut b);
        assert_eq!(b, a[..2]);
        assert_eq!(kv.ref_count(a[0]), 2);
        kv.free(&mut a);
        assert_eq!(kv.ref_count(b[0]), 1, "still held by b");
        assert_eq!(
            kv.num_free(),
            10 - 1 - 2,
            "a's third block is free (but cached)"
        );
        // a's third block is free yet still hits.
        assert_eq!(kv.lookup(&hashes, |i, s| s == &tokens[2 * i..2 * i + 2]), 3);
        kv.check();
    }

    #[test]
    fn colliding_hash_with_other_tokens_is_a_miss() {
        fn collide(_: Option<BlockHash>, _: &[u32], _: u64) -> BlockHash {
            42
        }
        let mut kv = BlockManager::with_hash(6, 2, true, collide);
        let mut a = Vec::new();
        kv.allocate(1, &mut a).unwrap();
        kv.register(a[0], collide(None, &[1, 2], 0), &[1, 2]);
        assert_eq!(kv.lookup(&[42], |_, s| s == [1, 2]), 1);
        assert_eq!(
            kv.lookup(&[42], |_, s| s == [7, 7]),
            0,
            "same hash, other tokens: miss"
        );
    }

    #[test]
    fn eviction_is_lru_with_tails_first() {
        let mut kv = BlockManager::new(5, 1, true); // 4 usable blocks of 1 token
        let toks = [10u32, 11, 12, 13];
        let hashes = chain(&toks, 1, xxhash_block);
        let mut a = Vec::new();
        kv.allocate(2, &mut a).unwrap();
        kv.register(a[0], hashes[0], &toks[0..1]);
        kv.register(a[1], hashes[1], &toks[1..2]);
        let mut b = Vec::new();
        kv.allocate(2, &mut b).unwrap();
        kv.free(&mut a); // a[1] then a[0] go to the tail: a[1] is older -> evicted first
        assert_eq!(kv.num_free(), 2);
        let mut c = Vec::new();
        kv.allocate(1, &mut c).unwrap();
        assert_eq!(
            kv.lookup(&hashes[..2], |i, s| s == &toks[i..i + 1]),
            1,
            "the tail block was evicted, the prefix survives"
        );
        kv.allocate(1, &mut c).unwrap();
        assert_eq!(kv.lookup(&hashes[..2], |i, s| s == &toks[i..i + 1]), 0);
        assert_eq!(kv.num_cached(), 0);
        kv.check();
    }

    #[test]
    fn caching_off_never_hits() {
        let mut kv = BlockManager::new(4, 1, false);
        let mut a = Vec::new();
        kv.allocate(1, &mut a).unwrap();
        kv.register(a[0], 5, &[1]);
        assert_eq!(kv.lookup(&[5], |_, s| s == [1]), 0);
    }

    proptest! {
        /// Any sequence of allocations, cache hits and frees conserves blocks, keeps ref counts
        /// equal to table membership, and never double-books a block.
        #[test]
        fn no_leak_no_double_booking(ops in proptest::collection::vec((0usize..6, 0u32..5, 0u8..3), 1..200)) {
            let mut kv = BlockManager::new(33, 1, true);
            let mut tables: Vec<Vec<BlockId>> = vec![Vec::new(); 6];
            let mut next_token = 0u32;
            let mut registered: Vec<(BlockHash, u32)> = Vec::new();
            for (t, n, op) in ops {
                match op {
                    0 => kv.free(&mut tables[t]),
                    1 => {
                        let before = tables[t].len();
                        match kv.allocate(n, &mut tables[t]) {
                            Ok(()) => {
                                for &b in &tables[t][before..] {
                                    let h = xxhash_block(None, &[next_token], 0);
                                    kv.register(b, h, &[next_token]);
                                    registered.push((h, next_token));
                                    next_token += 1;
                                }
                            }
                            Err(_) => prop_assert_eq!(tables[t].len(), before),
                        }
                    }
                    _ => {
                        if let Some(&(h, tok)) = registered.get(n as usize) {
                            if kv.lookup(&[h], |_, s| s == [tok]) == 1 {
                                kv.acquire_cached(&[h], &mut tables[t]);
                            }
                        }
                    }
                }
                kv.check();
                let mut refs = std::collections::HashMap::new();
                for b in tables.iter().flatten() {
                    *refs.entry(*b).or_insert(0u32) += 1;
                }
                for (b, r) in &refs {
                    prop_assert_eq!(kv.ref_count(*b), *r);
                }
                prop_assert_eq!(refs.len() as u32 + kv.num_free(), kv.num_usable());
            }
            for t in &mut tables {
                kv.free(t);
            }
            prop_assert_eq!(kv.num_free(), kv.num_usable());
        }
    }
}
