//! `CpuModel::forward` against a reference written as plainly as possible: one sequence,
//! contiguous K/V, unfused weights, f64 everywhere, RoPE frequencies recomputed from the
//! formulas. Every batching shape the engine uses must agree with it: whole-prompt prefill,
//! chunked prefill, token-by-token decode, and mixed batches of several sequences whose block
//! tables are shuffled.

use serde_json::json;

use super::WeightDtype;
use super::{Activation, Architecture, Checkpoint, CpuModel, KvCache, LayerTensor, ModelConfig};
use super::{LayerAttention, Llama3Scaling, ModelDir, RopeScaling, SeqChunk, SlidingWindow};
use crate::gen_model::{
    config_json, gemma3_config_json, write_model, ModelSpec, SpecialIds, WeightInit,
};
use crate::splitmix::SplitMix64;

const TOL: f64 = 1e-4;

/// The tests' generator, with `below` over `usize`.
struct Rng(SplitMix64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0.below(n as u64) as usize
    }
}

struct Case {
    config: ModelConfig,
    _dir: tempfile::TempDir,
    model_dir: ModelDir,
}

#[allow(clippy::too_many_arguments)]
fn case(
    arch: Architecture,
    hidden: usize,
    heads: usize,
    kv: usize,
    head_dim: usize,
    vocab: usize,
    scaling: bool,
    seed: u64,
) -> Case {
    let config = ModelConfig {
        architecture: arch,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: hidden * 3 / 2,
        num_layers: 2,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: scaling.then_some(RopeScaling::Llama3(Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        })),
        max_position_embeddings: 4096,
        tie_word_embeddings: arch == Architecture::Qwen3,
        dtype: Some(WeightDtype::F32),
        hidden_act: Activation::Silu,
        query_pre_attn_scalar: None,
        sliding: None,
        fp8: None,
    };
    make_case(config, seed)
}

/// A Gemma 3 case: three layers (sliding, full, sliding) with `window`, linear RoPE scaling on
/// the full layer, a `query_pre_attn_scalar` that is not head_dim.
fn gemma_case(
    hidden: usize,
    heads: usize,
    kv: usize,
    head_dim: usize,
    window: usize,
    seed: u64,
) -> Case {
    let mut c = case(
        Architecture::Llama,
        hidden,
        heads,
        kv,
        head_dim,
        103,
        false,
        seed,
    )
    .config;
    c.architecture = Architecture::Gemma3;
    c.num_layers = 3;
    c.rms_norm_eps = 1e-6;
    c.rope_theta = 1_000_000.0;
    c.rope_scaling = Some(RopeScaling::Linear { factor: 4.0 });
    c.tie_word_embeddings = true;
    c.hidden_act = Activation::GeluTanh;
    c.query_pre_attn_scalar = Some(head_dim as f32 * 1.5);
    c.sliding = Some(SlidingWindow {
        window,
        layers: vec![
            LayerAttention::Sliding,
            LayerAttention::Full,
            LayerAttention::Sliding,
        ],
        rope_theta: 10_000.0,
    });
    make_case(c, seed)
}

fn make_case(config: ModelConfig, seed: u64) -> Case {
    let hidden = config.hidden_size;
    let ids = SpecialIds {
        bos: 0,
        config_eos: json!(1),
        generation_eos: vec![1],
        pad: None,
    };
    let config_json = match config.architecture {
        Architecture::Gemma3 => gemma3_config_json(&config, &ids, true),
        _ => config_json(&config, &ids, false),
    };
    let spec = ModelSpec {
        config_json,
        generation_json: json!({"eos_token_id": [1]}),
        dtype: WeightDtype::F32,
        seed,
        // Unit-variance activations so attention is far from uniform and every term matters.
        init: WeightInit {
            matrix_std: 1.0 / (hidden as f32).sqrt(),
            norm_std: 0.2,
        },
        max_shard_size: u64::MAX,
        config: config.clone(),
    };
    let dir = tempfile::tempdir().expect("tempdir");
    write_model(dir.path(), &spec).expect("write model");
    let model_dir = ModelDir::open(dir.path()).expect("open");
    assert_eq!(model_dir.config, config);
    Case {
        config,
        _dir: dir,
        model_dir,
    }
}

/// Logits (f64) at every position of `tokens`, computed plainly.
fn reference_logits(c: &ModelConfig, dir: &ModelDir, tokens: &[u32]) -> Vec<Vec<f64>> {
    let ck = Checkpoint::open(&dir.path).expect("checkpoint");
    let get = |name: &str, shape: Vec<usize>| -> Vec<f64> {
        ck.get(name, &shape)
            .expect("tensor")
            .to_f32()
            .into_iter()
            .map(f64::from)
            .collect()
    };
    let (h, nh, nkv, hd, t_len) = (
        c.hidden_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        tokens.len(),
    );
    let eps = c.rms_norm_eps as f64;
    let gemma = c.architecture == Architecture::Gemma3;
    let w_off = if gemma { 1.0 } else { 0.0 };
    let norm = |x: &[f64], w: &[f64]| -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        x.iter()
            .zip(w)
            .map(|(v, w)| (w_off + w) * v / (ms + eps).sqrt())
            .collect()
    };
    let matvec = |w: &[f64], x: &[f64]| -> Vec<f64> {
        w.chunks(x.len())
            .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    };
    // inv_freq in f64 per layer kind, llama3 bands and linear scaling written out again.
    let inv_freq_of = |kind: LayerAttention| -> Vec<f64> {
        let (theta, scaling) = match (kind, &c.sliding) {
            (LayerAttention::Sliding, Some(sw)) => (sw.rope_theta as f64, None),
            _ => (c.rope_theta as f64, c.rope_scaling.as_ref()),
        };
        (0..hd / 2)
            .map(|i| {
                let f = 1.0 / theta.powf(2.0 * i as f64 / hd as f64);
                let s = match scaling {
                    None => return f,
                    Some(RopeScaling::Linear { factor }) => return f / *factor as f64,
                    Some(RopeScaling::Llama3(s)) => s,
                };
                let (lo, hi, fac) = (
                    s.low_freq_factor as f64,
                    s.high_freq_factor as f64,
                    s.factor as f64,
                );
                let old = s.original_max_position_embeddings as f64;
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < old / hi {
                    f
                } else if wavelen > old / lo {
                    f / fac
                } else {
                    let smooth = (old / wavelen - lo) / (hi - lo);
                    (1.0 - smooth) * f / fac + smooth * f
                }
            })
            .collect()
    };
    let rope = |v: &mut [f64], pos: usize, inv_freq: &[f64]| {
        for head in v.chunks_mut(hd) {
            let half = hd / 2;
            for i in 0..half {
                let a = pos as f64 * inv_freq[i];
                let (x1, x2) = (head[i], head[i + half]);
                head[i] = x1 * a.cos() - x2 * a.sin();
                head[i + half] = x2 * a.cos() + x1 * a.sin();
            }
        }
    };
    let scale = match c.query_pre_attn_scalar {
        Some(q) => 1.0 / (q as f64).sqrt(),
        None => 1.0 / (hd as f64).sqrt(),
    };
    let embed = get("model.embed_tokens.weight", vec![c.vocab_size, h]);
    let embed_scale = if gemma { (h as f64).sqrt() } else { 1.0 };
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| {
            embed[t as usize * h..][..h]
                .iter()
                .map(|v| v * embed_scale)
                .collect()
        })
        .collect();
    for l in 0..c.num_layers {
        let kind = c
            .sliding
            .as_ref()
            .map_or(LayerAttention::Full, |s| s.layers[l]);
        let inv_freq = inv_freq_of(kind);
        let window = match (kind, &c.sliding) {
            (LayerAttention::Sliding, Some(sw)) => sw.window,
            _ => usize::MAX,
        };
        let w = |t: LayerTensor| get(&t.name(l), t.shape(c));
        let (wq, wk, wv, wo) = (
            w(LayerTensor::QProj),
            w(LayerTensor::KProj),
            w(LayerTensor::VProj),
            w(LayerTensor::OProj),
        );
        let (n_in, n_post) = (w(LayerTensor::InputNorm), w(LayerTensor::PostNorm));
        let (wg, wu, wd) = (
            w(LayerTensor::GateProj),
            w(LayerTensor::UpProj),
            w(LayerTensor::DownProj),
        );
        let qk_norm = matches!(c.architecture, Architecture::Qwen3 | Architecture::Gemma3)
            .then(|| (w(LayerTensor::QNorm), w(LayerTensor::KNorm)));
        let ff_norms = gemma.then(|| (w(LayerTensor::PreFfNorm), w(LayerTensor::PostFfNorm)));
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let hn = norm(x, &n_in);
            let (mut q, mut k) = (matvec(&wq, &hn), matvec(&wk, &hn));
            if let Some((qn, kn)) = &qk_norm {
                q = q.chunks(hd).flat_map(|hq| norm(hq, qn)).collect();
                k = k.chunks(hd).flat_map(|hk| norm(hk, kn)).collect();
            }
            rope(&mut q, pos, &inv_freq);
            rope(&mut k, pos, &inv_freq);
            qs.push(q);
            ks.push(k);
            vs.push(matvec(&wv, &hn));
        }
        for t in 0..t_len {
            let mut attn = vec![0.0; nh * hd];
            for head in 0..nh {
                let kvh = head / (nh / nkv);
                let q = &qs[t][head * hd..][..hd];
                // Keys t - window + 1 ..= t (transformers: kv_idx > q_idx - sliding_window).
                let first = (t + 1).saturating_sub(window);
                let scores: Vec<f64> = (first..=t)
                    .map(|s| {
                        q.iter()
                            .zip(&ks[s][kvh * hd..][..hd])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (s, p) in (first..).zip(e.iter()) {
                    for d in 0..hd {
                        attn[head * hd + d] += p / z * vs[s][kvh * hd + d];
                    }
                }
            }
            let mut o = matvec(&wo, &attn);
            if gemma {
                o = norm(&o, &n_post);
            }
            let x = &mut xs[t];
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let hn = match &ff_norms {
                Some((pre, _)) => norm(x, pre),
                None => norm(x, &n_post),
            };
            let (g, u) = (matvec(&wg, &hn), matvec(&wu, &hn));
            let act: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| match c.hidden_act {
                    Activation::Silu => g / (1.0 + (-g).exp()) * u,
                    Activation::GeluTanh => {
                        let k = (2.0 / std::f64::consts::PI).sqrt();
                        0.5 * g * (1.0 + (k * (g + 0.044715 * g * g * g)).tanh()) * u
                    }
                })
                .collect();
            let mut d = matvec(&wd, &act);
            if let Some((_, post)) = &ff_norms {
                d = norm(&d, post);
            }
            x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        }
    }
    let fnorm = get("model.norm.weight", vec![h]);
    let head = if c.tie_word_embeddings {
        embed.clone()
    } else {
        get("lm_head.weight", vec![c.vocab_size, h])
    };
    xs.iter().map(|x| matvec(&head, &norm(x, &fnorm))).collect()
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (a, b)| m.max((*a as f64 - b).abs()));
    assert!(
        scale > 0.1,
        "{what}: degenerate reference logits (max |logit| {scale})"
    );
    assert!(
        err / scale < TOL,
        "{what}: relative error {:.3e}",
        err / scale
    );
}

/// Runs one sequence through `forward` in the given chunk lengths; checks every chunk's logits.
fn check_chunked(
    case: &Case,
    model: &mut CpuModel,
    tokens: &[u32],
    chunks: &[usize],
    block_size: usize,
    want: &[Vec<f64>],
    what: &str,
) {
    let c = &case.config;
    let blocks = tokens.len().div_ceil(block_size);
    let mut cache = KvCache::new(c, blocks + 3, block_size);
    // Reverse order: block ids unrelated to positions.
    let table: Vec<u32> = (0..blocks as u32).rev().map(|b| b + 2).collect();
    let mut logits = vec![f32::NAN; c.vocab_size];
    let mut pos = 0;
    for &n in chunks {
        let chunk = SeqChunk {
            tokens: &tokens[pos..pos + n],
            position: pos,
            block_table: &table,
            local_block_table: &[],
            logit_rows: 1,
        };
        model
            .forward(&[chunk], &mut cache, &mut logits)
            .expect("forward");
        pos += n;
        assert_close(
            &logits,
            &want[pos - 1],
            &format!("{what}, chunk ending at {pos}"),
        );
    }
    assert_eq!(pos, tokens.len());
}

fn random_tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab) as u32).collect()
}

fn run_case(case: &Case, seed: u64) {
    let c = &case.config;
    let mut rng = Rng(SplitMix64(seed));
    let mut model = CpuModel::load(&case.model_dir).expect("load");
    let tokens = random_tokens(&mut rng, 41, c.vocab_size);
    let want = reference_logits(c, &case.model_dir, &tokens);

    check_chunked(
        case,
        &mut model,
        &tokens,
        &[tokens.len()],
        16,
        &want,
        "whole prefill",
    );
    check_chunked(
        case,
        &mut model,
        &tokens,
        &vec![1; tokens.len()],
        4,
        &want,
        "decode",
    );
    for trial in 0..3 {
        let mut chunks = Vec::new();
        let mut left = tokens.len();
        while left > 0 {
            let n = 1 + rng.below(left.min(12));
            chunks.push(n);
            left -= n;
        }
        let bs = [1, 3, 16][trial];
        check_chunked(
            case,
            &mut model,
            &tokens,
            &chunks,
            bs,
            &want,
            &format!("chunks {chunks:?} bs {bs}"),
        );
    }
    check_batched(case, &mut model, &mut rng);
}

/// Several sequences advancing together, each step a random mix of prefill chunks and decodes,
/// with block tables drawn from a shuffled pool.
fn check_batched(case: &Case, model: &mut CpuModel, rng: &mut Rng) {
    let c = &case.config;
    let block_size = 4;
    let lens = [23usize, 1, 9, 30];
    let seqs: Vec<Vec<u32>> = lens
        .iter()
        .map(|&n| random_tokens(rng, n, c.vocab_size))
        .collect();
    let wants: Vec<Vec<Vec<f64>>> = seqs
        .iter()
        .map(|s| reference_logits(c, &case.model_dir, s))
        .collect();
    let total_blocks: usize = lens.iter().map(|n| n.div_ceil(block_size)).sum();
    let mut pool: Vec<u32> = (0..total_blocks as u32 + 5).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, rng.below(i + 1));
    }
    let tables: Vec<Vec<u32>> = lens
        .iter()
        .map(|n| {
            (0..n.div_ceil(block_size))
                .map(|_| pool.pop().expect("pool"))
                .collect()
        })
        .collect();
    let mut cache = KvCache::new(c, total_blocks + 5, block_size);
    let mut done = vec![0usize; seqs.len()];
    let mut logits = vec![0.0f32; lens.iter().sum::<usize>() * c.vocab_size];
    let mut step = 0;
    while done.iter().zip(&lens).any(|(d, n)| d < n) {
        let mut batch = Vec::new();
        let mut owners = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            let left = lens[i] - done[i];
            if left == 0 || rng.below(4) == 0 {
                continue; // finished, or sits this step out
            }
            let n = if rng.below(2) == 0 {
                1
            } else {
                1 + rng.below(left)
            }
            .min(left);
            // Usually the last row's logits (prefill, decode), sometimes none, sometimes every
            // row's (a speculative verification).
            let logit_rows = match rng.below(4) {
                _ if n == left => 1,
                0 => 0,
                1 => 1 + rng.below(n),
                _ => 1,
            };
            batch.push(SeqChunk {
                tokens: &s[done[i]..done[i] + n],
                position: done[i],
                block_table: &tables[i],
                local_block_table: &[],
                logit_rows,
            });
            owners.push((i, done[i] + n, logit_rows));
            done[i] += n;
        }
        model
            .forward(&batch, &mut cache, &mut logits)
            .expect("forward");
        let mut row = 0;
        for &(i, end, logit_rows) in &owners {
            for (j, want) in wants[i][end - logit_rows..end].iter().enumerate() {
                let got = &logits[row * c.vocab_size..][..c.vocab_size];
                let at = end - logit_rows + j + 1;
                assert_close(got, want, &format!("batched step {step}, seq {i} at {at}"));
                row += 1;
            }
        }
        step += 1;
    }
}

#[test]
fn llama_mha_head_dim_16() {
    run_case(&case(Architecture::Llama, 64, 4, 4, 16, 97, false, 1), 11);
}

#[test]
fn llama_gqa2_rope_scaling() {
    run_case(&case(Architecture::Llama, 64, 8, 4, 16, 89, true, 2), 12);
}

#[test]
fn llama_gqa4_head_dim_64_rope_scaling() {
    run_case(&case(Architecture::Llama, 128, 8, 2, 64, 113, true, 3), 13);
}

#[test]
fn qwen3_gqa4_head_dim_64() {
    run_case(&case(Architecture::Qwen3, 48, 4, 1, 64, 101, false, 4), 14);
}

#[test]
fn qwen3_gqa2_head_dim_16() {
    run_case(&case(Architecture::Qwen3, 64, 4, 2, 16, 64, false, 5), 15);
}

#[test]
fn gemma3_window_8_gqa2_head_dim_16() {
    run_case(&gemma_case(64, 4, 2, 16, 8, 7), 16);
}

#[test]
fn gemma3_window_5_mqa_head_dim_32() {
    run_case(&gemma_case(48, 2, 1, 32, 5, 8), 17);
}

/// The reference's window is live: a window of 4 changes the logits from position 4 on and
/// not before (so the Gemma cases above test windowed attention, not full attention); a window
/// wider than the sequence passes the CPU model too.
#[test]
fn gemma3_window_changes_logits_only_past_it() {
    let wide = gemma_case(64, 4, 2, 16, 1000, 9);
    let tokens: Vec<u32> = (0..41).map(|i| (i * 7 % 103) as u32).collect();
    let a = reference_logits(&wide.config, &wide.model_dir, &tokens);
    let mut narrow_cfg = wide.config.clone();
    if let Some(s) = &mut narrow_cfg.sliding {
        s.window = 4;
    }
    let b = reference_logits(&narrow_cfg, &wide.model_dir, &tokens);
    // The window matters from position 4 on, and not before.
    assert_eq!(a[3], b[3]);
    assert_ne!(a[40], b[40]);
    run_case(&wide, 18);
}

#[test]
fn forward_rejects_bad_batches() {
    let case = case(Architecture::Llama, 64, 4, 2, 16, 50, false, 6);
    let mut model = CpuModel::load(&case.model_dir).expect("load");
    let mut cache = KvCache::new(&case.config, 4, 4);
    let mut logits = vec![0.0; 50];
    let mut run = |tokens: &[u32], table: &[u32], logits: &mut [f32]| {
        let chunk = SeqChunk {
            tokens,
            position: 0,
            block_table: table,
            local_block_table: &[],
            logit_rows: 1,
        };
        model
            .forward(&[chunk], &mut cache, logits)
            .expect_err("bad batch")
            .to_string()
    };
    assert!(run(&[1, 50], &[0], &mut logits).contains("vocabulary"));
    assert!(run(&[1; 5], &[0], &mut logits).contains("block table"));
    assert!(run(&[1; 2], &[9], &mut logits).contains("outside the cache"));
    assert!(run(&[1; 2], &[0], &mut logits[..10]).contains("logits buffer"));
}
