use super::{KvCache, ModelDir, ModelError};

/// One sequence's chunk of input tokens in a forward batch.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` (= tokens already in the cache for this sequence).
    pub position: usize,
    pub block_table: &'a [u32],
    pub want_logits: bool,
}

pub struct CpuModel {}

impl CpuModel {
    pub fn load(dir: &ModelDir) -> Result<CpuModel, ModelError> {
        todo!("{:?}", dir.path)
    }
    pub fn forward(&mut self, seqs: &[SeqChunk<'_>], cache: &mut KvCache, logits: &mut [f32]) -> anyhow::Result<()> {
        todo!("{} {} {}", seqs.len(), std::mem::size_of_val(cache), logits.len())
    }
}
