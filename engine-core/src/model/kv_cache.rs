//! The paged KV cache of the CPU backend.
//!
//! Per layer, one K and one V array of shape `[num_blocks, block_size, num_kv_heads, head_dim]`
//! (f32, row-major). A sequence owns a list of blocks, its block table; the K/V of its position
//! `p` lives in block `block_table[p / block_size]` at slot `p % block_size`:
//!
//! ```text
//!  block_table = [7, 2, 5]            block_size = 4
//!  positions     0 1 2 3 | 4 5 6 7 | 8 9
//!  block         --- 7 ---  --- 2 ---  - 5 -
//!
//!  k[layer]: | blk 0 | blk 1 | blk 2            | ... | blk 7            | ...
//!                            |slot0|slot1|...   |     |slot0|slot1|...
//!                             [kvh0: hd][kvh1: hd]...
//! ```
//!
//! Attention reads K/V straight from these blocks through the block table; nothing is gathered
//! into a contiguous copy. Blocks may be shared read-only between sequences (prefix caching):
//! a forward pass only writes the positions its chunks compute.
//!
//! A hybrid cache ([`KvCache::hybrid`], for sliding-window models) gives the sliding layers
//! arrays of their own pool's `num_local_blocks` blocks, addressed through the sequence's local
//! block table (`crate::scheduler::LocalKvConfig`).

use super::{LayerAttention, ModelConfig};

pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    num_blocks: usize,
    /// Blocks of the sliding layers' pool (hybrid caches; else 0).
    num_local_blocks: usize,
    /// Per layer: addressed through the local block table.
    local: Vec<bool>,
    block_size: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl KvCache {
    /// A cache whose sliding-window layers keep `num_local_blocks` blocks of their own pool
    /// and whose full-attention layers keep `num_blocks`.
    pub fn hybrid(
        config: &ModelConfig,
        num_blocks: usize,
        num_local_blocks: usize,
        block_size: usize,
    ) -> KvCache {
        let mut c = KvCache::new(config, 0, block_size);
        let slot = block_size * config.num_kv_heads * config.head_dim;
        c.local = (0..config.num_layers)
            .map(|l| config.layer_attention(l) == LayerAttention::Sliding)
            .collect();
        for (l, &local) in c.local.iter().enumerate() {
            let blocks = if local { num_local_blocks } else { num_blocks };
            let n = blocks
                .checked_mul(slot)
                .expect("KvCache: size overflows usize");
            c.k[l] = vec![0.0; n];
            c.v[l] = vec![0.0; n];
        }
        c.num_blocks = num_blocks;
        c.num_local_blocks = num_local_blocks;
        c
    }

    /// Whether layer `layer` is addressed through the local block table.
    pub fn is_local(&self, layer: usize) -> bool {
        self.local.get(layer).copied().unwrap_or(false)
    }

    /// Blocks of the sliding layers' pool (0 unless hybrid).
    pub fn num_local_blocks(&self) -> usize {
        self.num_local_blocks
    }

    /// Bytes of one block of the sliding layers' pool (hybrid caches).
    pub fn bytes_per_local_block(config: &ModelConfig, block_size: usize) -> usize {
        config.num_sliding_layers() * 2 * block_size * config.num_kv_heads * config.head_dim * 4
    }

    /// Bytes of one block of the full layers' pool of a hybrid cache.
    pub fn bytes_per_full_block(config: &ModelConfig, block_size: usize) -> usize {
        Self::bytes_per_block(config, block_size) - Self::bytes_per_local_block(config, block_size)
    }

    /// Allocates zeroed K/V for `num_blocks` blocks of `block_size` tokens (pages are touched
    /// lazily by the OS, so an oversized cache costs address space, not memory, until used).
    pub fn new(config: &ModelConfig, num_blocks: usize, block_size: usize) -> KvCache {
        assert!(block_size > 0, "KvCache: block_size must be positive");
        let per_layer = num_blocks
            .checked_mul(block_size * config.num_kv_heads * config.head_dim)
            .expect("KvCache: size overflows usize");
        let alloc = || {
            (0..config.num_layers)
                .map(|_| vec![0.0f32; per_layer])
                .collect()
        };
        KvCache {
            k: alloc(),
            v: alloc(),
            num_blocks,
            num_local_blocks: 0,
            local: vec![false; config.num_layers],
            block_size,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
        }
    }

    pub fn bytes_per_block(config: &ModelConfig, block_size: usize) -> usize {
        config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * 4
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_layers(&self) -> usize {
        self.k.len()
    }

    /// Floats per token slot (`num_kv_heads * head_dim`).
    pub fn token_stride(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Offset (in floats) of position `pos`'s slot in a layer's K or V array.
    #[inline]
    pub fn slot_offset(&self, block_table: &[u32], pos: usize) -> usize {
        let block = block_table[pos / self.block_size] as usize;
        (block * self.block_size + pos % self.block_size) * self.token_stride()
    }

    /// K and V of one layer.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.k[layer], &self.v[layer])
    }

    /// K and V of one layer, writable.
    pub fn layer_mut(&mut self, layer: usize) -> (&mut [f32], &mut [f32]) {
        (&mut self.k[layer], &mut self.v[layer])
    }

    /// Copies block `src` onto block `dst` in every layer (copy-on-write of a shared block;
    /// not for hybrid caches, whose pools number their blocks apart).
    pub fn copy_block(&mut self, src: usize, dst: usize) {
        debug_assert_eq!(self.num_local_blocks, 0, "copy_block on a hybrid cache");
        let n = self.block_size * self.token_stride();
        for arr in self.k.iter_mut().chain(self.v.iter_mut()) {
            arr.copy_within(src * n..(src + 1) * n, dst * n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gen_model::Preset;

    #[test]
    fn slots_follow_the_block_table_and_copy_block_copies_every_layer() {
        let c = Preset::Micro.config();
        let mut cache = KvCache::new(&c, 6, 4);
        let stride = cache.token_stride();
        assert_eq!(stride, c.num_kv_heads * c.head_dim);
        // Position 5 of a sequence with blocks [3, 1] is block 1, slot 1.
        assert_eq!(cache.slot_offset(&[3, 1], 5), (4 + 1) * stride);
        for l in 0..cache.num_layers() {
            let (k, v) = cache.layer_mut(l);
            k[2 * 4 * stride] = 1.0 + l as f32;
            v[2 * 4 * stride + 3] = 2.0;
        }
        cache.copy_block(2, 5);
        for l in 0..cache.num_layers() {
            let (k, v) = cache.layer(l);
            assert_eq!(k[5 * 4 * stride], 1.0 + l as f32);
            assert_eq!(v[5 * 4 * stride + 3], 2.0);
        }
        assert_eq!(
            KvCache::bytes_per_block(&c, 4),
            c.num_layers * 2 * 4 * stride * 4
        );
    }
}
