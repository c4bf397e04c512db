//! Helpers shared by the model tests: generate a preset into a temp dir, run greedy decoding
//! through `CpuModel::forward` with a paged cache.

#![allow(dead_code)]

use std::path::Path;

use harrier_engine::gen_model::{self, GenModelArgs};
use harrier_engine::model::{CpuModel, KvCache, ModelDir, SeqChunk};

/// Generates `preset` with `seed` (no tokenizer) into `dir` and opens it.
pub fn gen_preset(preset: &str, seed: u64, dir: &Path) -> anyhow::Result<ModelDir> {
    let mut args = GenModelArgs::new(preset, dir);
    args.seed = seed;
    args.no_tokenizer = true;
    gen_model::run(&args)?;
    Ok(ModelDir::open(dir)?)
}

pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy continuation of every prompt, all in one batch: one prefill forward for all prompts,
/// then `steps - 1` decode forwards of one token each. `on_step(prompt, step, logits)` sees the
/// next-token logits of every step (step 0 comes from the prefill). Block tables interleave the
/// prompts' blocks so no sequence's blocks are contiguous or in order.
pub fn greedy_batch(
    model: &mut CpuModel,
    prompts: &[Vec<u32>],
    steps: usize,
    mut on_step: impl FnMut(usize, usize, &[f32]),
) -> anyhow::Result<Vec<Vec<u32>>> {
    let c = model.config().clone();
    let block_size = 16;
    let per_seq: Vec<usize> = prompts
        .iter()
        .map(|p| (p.len() + steps).div_ceil(block_size))
        .collect();
    let max_blocks = per_seq.iter().copied().max().unwrap_or(0);
    let n = prompts.len();
    // Block j of sequence i is block (max_blocks - 1 - j) * n + i: interleaved and reversed.
    let tables: Vec<Vec<u32>> = (0..n)
        .map(|i| {
            (0..per_seq[i])
                .map(|j| ((max_blocks - 1 - j) * n + i) as u32)
                .collect()
        })
        .collect();
    let mut cache = KvCache::new(&c, max_blocks * n, block_size);
    let mut logits = vec![0.0f32; n * c.vocab_size];
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); n];
    let chunks: Vec<SeqChunk<'_>> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| SeqChunk {
            tokens: p,
            position: 0,
            block_table: t,
            local_block_table: &[],
            logit_rows: 1,
        })
        .collect();
    model.forward(&chunks, &mut cache, &mut logits)?;
    for step in 0..steps {
        for (i, o) in out.iter_mut().enumerate() {
            let row = &logits[i * c.vocab_size..(i + 1) * c.vocab_size];
            on_step(i, step, row);
            o.push(argmax(row));
        }
        if step + 1 == steps {
            break;
        }
        let chunks: Vec<SeqChunk<'_>> = (0..n)
            .map(|i| SeqChunk {
                tokens: &out[i][step..step + 1],
                position: prompts[i].len() + step,
                block_table: &tables[i],
                local_block_table: &[],
                logit_rows: 1,
            })
            .collect();
        model.forward(&chunks, &mut cache, &mut logits)?;
    }
    Ok(out)
}
