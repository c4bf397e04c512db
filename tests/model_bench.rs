//! CPU forward timings (ignored by default; run in release):
//!
//! ```text
//! cargo test --release -p harrier-tests --test model_bench -- --ignored --nocapture
//! ```
//!
//! Prints, for the `tiny` preset: prefill throughput, and decode step time at batch 1 and 8
//! (medians over the steps), with the weight-read floor for reference.

#[path = "model_support.rs"]
mod model_support;

use std::time::Instant;

use harrier_engine::model::{CpuModel, KvCache, SeqChunk};
use model_support::gen_preset;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[test]
#[ignore = "timing; run in release with --ignored --nocapture"]
fn tiny_forward_timings() {
    let dir = tempfile::tempdir().expect("tempdir");
    let md = gen_preset("tiny", 0, dir.path()).expect("generate");
    let mut model = CpuModel::load(&md).expect("load");
    let c = md.config.clone();
    let (block_size, prompt_len, steps) = (16usize, 128usize, 32usize);
    let blocks_per_seq = (prompt_len + steps).div_ceil(block_size);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    for batch in [1usize, 8] {
        let mut cache = KvCache::new(&c, blocks_per_seq * batch, block_size);
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|i| {
                (0..blocks_per_seq)
                    .map(|j| (j * batch + i) as u32)
                    .collect()
            })
            .collect();
        let prompts: Vec<Vec<u32>> = (0..batch)
            .map(|i| {
                (0..prompt_len)
                    .map(|t| ((t * 7919 + i * 104729) % c.vocab_size) as u32)
                    .collect()
            })
            .collect();
        let mut logits = vec![0.0f32; batch * c.vocab_size];
        let chunks: Vec<SeqChunk<'_>> = (0..batch)
            .map(|i| SeqChunk {
                tokens: &prompts[i],
                position: 0,
                block_table: &tables[i],
                local_block_table: &[],
                logit_rows: 1,
            })
            .collect();
        let t = Instant::now();
        model
            .forward(&chunks, &mut cache, &mut logits)
            .expect("prefill");
        let prefill = t.elapsed().as_secs_f64();
        let mut times = Vec::new();
        let next: Vec<u32> = (0..batch as u32).collect();
        for step in 0..steps {
            let chunks: Vec<SeqChunk<'_>> = (0..batch)
                .map(|i| SeqChunk {
                    tokens: &next[i..i + 1],
                    position: prompt_len + step,
                    block_table: &tables[i],
                    local_block_table: &[],
                    logit_rows: 1,
                })
                .collect();
            let t = Instant::now();
            model
                .forward(&chunks, &mut cache, &mut logits)
                .expect("decode");
            times.push(t.elapsed().as_secs_f64());
        }
        let step = median(times);
        eprintln!(
            "tiny, {threads} threads, batch {batch}: prefill {} tokens in {:.1} ms ({:.0} tok/s); \
             decode step {:.2} ms median ({:.0} tok/s)",
            batch * prompt_len,
            prefill * 1e3,
            (batch * prompt_len) as f64 / prefill,
            step * 1e3,
            batch as f64 / step
        );
    }
    let weight_bytes = 4
        * (c.vocab_size * c.hidden_size
            + c.num_layers
                * (c.hidden_size * (c.qkv_dim() + c.num_heads * c.head_dim)
                    + 3 * c.hidden_size * c.intermediate_size));
    eprintln!(
        "tiny f32 weights read per decode step: {:.1} MB",
        weight_bytes as f64 / 1e6
    );
}
