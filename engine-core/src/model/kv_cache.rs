use super::ModelConfig;

pub struct KvCache {}

impl KvCache {
    pub fn new(config: &ModelConfig, num_blocks: usize, block_size: usize) -> KvCache {
        todo!("{config:?} {num_blocks} {block_size}")
    }
    pub fn bytes_per_block(config: &ModelConfig, block_size: usize) -> usize {
        config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * 4
    }
}
