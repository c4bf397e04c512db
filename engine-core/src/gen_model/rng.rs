//! Counter-based normal samples for weights: value `i` of tensor `name` under `seed` is a pure
//! function of `(seed, name, i)`, so tensors can be generated in parallel, in any order, in
//! chunks, and come out identical whatever the thread count.
//!
//! Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3") keyed by a hash
//! of `(seed, name)`, counter = `i / 4`; each 128-bit output gives two Box-Muller pairs, i.e.
//! the normals of elements `4c .. 4c + 4`.
//!
//! The stream is part of the checkpoint format of generated models (committed parity fixtures
//! depend on it): do not change it without regenerating the fixtures.

use crate::sampling::philox::philox4x32_10;
use crate::splitmix::splitmix64;

/// The key of one tensor's stream.
#[derive(Debug, Clone, Copy)]
pub struct StreamKey([u32; 2]);

impl StreamKey {
    pub fn new(seed: u64, name: &str) -> StreamKey {
        // FNV-1a over the name, mixed with the seed through splitmix64's finalizer.
        let mut h: u64 = 0xCBF2_9CE4_8422_2325;
        for &b in name.as_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01B3);
        }
        let k = splitmix64(h ^ splitmix64(seed));
        StreamKey([k as u32, (k >> 32) as u32])
    }
}

/// Philox4x32-10 (the same function the sampler uses) over this tensor's key.
#[inline]
pub fn philox(key: StreamKey, counter: u64) -> [u32; 4] {
    philox4x32_10([counter as u32, (counter >> 32) as u32, 0, 0], key.0)
}

#[inline]
fn box_muller(a: u32, b: u32) -> (f64, f64) {
    const TWO_POW_32: f64 = 4_294_967_296.0;
    let u1 = (a as f64 + 1.0) / TWO_POW_32; // (0, 1]: log is finite
    let u2 = b as f64 / TWO_POW_32;
    let r = (-2.0 * u1.ln()).sqrt();
    let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
    (r * c, r * s)
}

/// Standard normal samples `start .. start + out.len()` of the stream.
pub fn fill_normal(key: StreamKey, start: u64, out: &mut [f64]) {
    let mut i = start;
    let mut k = 0;
    while k < out.len() {
        let block = philox(key, i / 4);
        let (z0, z1) = box_muller(block[0], block[1]);
        let (z2, z3) = box_muller(block[2], block[3]);
        let zs = [z0, z1, z2, z3];
        let lane = (i % 4) as usize;
        let take = (4 - lane).min(out.len() - k);
        out[k..k + take].copy_from_slice(&zs[lane..lane + take]);
        k += take;
        i += take as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunking_does_not_change_values_and_moments_are_normal() {
        let key = StreamKey::new(7, "model.layers.0.mlp.up_proj.weight");
        let mut whole = vec![0.0; 10_001];
        fill_normal(key, 0, &mut whole);
        let mut parts = vec![0.0; 10_001];
        let (a, b) = parts.split_at_mut(4_999);
        fill_normal(key, 0, a);
        fill_normal(key, 4_999, b);
        assert_eq!(whole, parts);
        let n = whole.len() as f64;
        let mean = whole.iter().sum::<f64>() / n;
        let var = whole.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
        assert!(
            mean.abs() < 0.05 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
        let other = StreamKey::new(8, "model.layers.0.mlp.up_proj.weight");
        let mut o = vec![0.0; 4];
        fill_normal(other, 0, &mut o);
        assert_ne!(o[..], whole[..4]);
    }
}
