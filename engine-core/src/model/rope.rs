//! Rotary position embedding, as Hugging Face computes it.
//!
//! - `inv_freq[i] = 1 / theta^(2i / head_dim)` for `i < head_dim / 2`, in f32 like torch;
//! - Llama 3 scaling rewrites `inv_freq` as transformers' `_compute_llama3_parameters`:
//!   wavelengths shorter than `orig / high_freq_factor` are kept, longer than
//!   `orig / low_freq_factor` are divided by `factor`, and the band between is interpolated;
//! - angle `= position * inv_freq[i]` (f32), applied with the rotate-half convention:
//!
//! ```text
//!   x = [x1 | x2]  (halves of head_dim)
//!   out = x * [cos | cos] + [-x2 | x1] * [sin | sin]
//! ```

use super::config::{LayerAttention, Llama3Scaling, ModelConfig, RopeScaling};

pub struct Rope {
    inv_freq: Vec<f32>,
}

/// The inverse frequencies of the layers of kind `kind` (`head_dim / 2` of them): full layers
/// use `rope_theta` and `rope_scaling`; sliding layers (Gemma 3) their own unscaled base. The
/// CUDA backend uploads these same values.
pub fn inv_freq(config: &ModelConfig, kind: LayerAttention) -> Vec<f32> {
    let dim = config.head_dim;
    let (base, scaling) = match (kind, &config.sliding) {
        (LayerAttention::Sliding, Some(s)) => (s.rope_theta, None),
        _ => (config.rope_theta, config.rope_scaling.as_ref()),
    };
    let mut inv_freq: Vec<f32> = (0..dim / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32))
        .collect();
    match scaling {
        None => {}
        Some(RopeScaling::Llama3(s)) => {
            for f in &mut inv_freq {
                *f = llama3_scale(*f, s);
            }
        }
        // transformers' `_compute_linear_scaling_rope_parameters`: inv_freq / factor, in f32.
        Some(RopeScaling::Linear { factor }) => {
            for f in &mut inv_freq {
                *f /= factor;
            }
        }
    }
    inv_freq
}

impl Rope {
    pub fn new(config: &ModelConfig, kind: LayerAttention) -> Rope {
        Rope {
            inv_freq: inv_freq(config, kind),
        }
    }

    /// Fills `cos` and `sin` (each `head_dim / 2` long) for `position`.
    pub fn cos_sin(&self, position: usize, cos: &mut [f32], sin: &mut [f32]) {
        let p = position as f32;
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let angle = (p * f) as f64;
            *c = angle.cos() as f32;
            *s = angle.sin() as f32;
        }
    }
}

/// transformers' `_compute_llama3_parameters`, one frequency at a time, in f32.
fn llama3_scale(inv_freq: f32, s: &Llama3Scaling) -> f32 {
    let old_context_len = s.original_max_position_embeddings as f32;
    let low_freq_wavelen = old_context_len / s.low_freq_factor;
    let high_freq_wavelen = old_context_len / s.high_freq_factor;
    let wavelen = 2.0 * std::f32::consts::PI / inv_freq;
    if wavelen < high_freq_wavelen {
        inv_freq
    } else if wavelen > low_freq_wavelen {
        inv_freq / s.factor
    } else {
        let smooth = (old_context_len / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * inv_freq / s.factor + smooth * inv_freq
    }
}

/// Rotates every `head_dim`-wide head of `x` (consecutive heads) by `cos`/`sin` (half wide).
#[inline]
pub fn apply(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        let (x1, x2) = head.split_at_mut(half);
        for i in 0..half {
            let (a, b) = (x1[i], x2[i]);
            x1[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[i] + a * sin[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inv_freq_matches_the_formula() {
        let m = crate::gen_model::Preset::from_name("llama-3.2-1b")
            .unwrap()
            .config();
        let f = inv_freq(&m, LayerAttention::Full);
        assert_eq!(f.len(), m.head_dim / 2);
        assert_eq!(f[0], 1.0);
        // Llama 3 scaling divides the lowest frequencies by the factor (32 for 3.2).
        let raw = 1.0
            / m.rope_theta
                .powf((m.head_dim - 2) as f32 / m.head_dim as f32);
        assert!(
            (f[f.len() - 1] - raw / 32.0).abs() < 1e-12,
            "{} {}",
            f[f.len() - 1],
            raw / 32.0
        );
    }

    #[test]
    fn llama3_scaling_bands() {
        let s = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        // High frequency (short wavelength): unchanged.
        assert_eq!(llama3_scale(1.0, &s), 1.0);
        // Very low frequency: divided by factor.
        let low = 2.0 * std::f32::consts::PI / 100_000.0;
        assert_eq!(llama3_scale(low, &s), low / 8.0);
        // In between: between inv/factor and inv.
        let mid = 2.0 * std::f32::consts::PI / 4096.0;
        let got = llama3_scale(mid, &s);
        assert!(got < mid && got > mid / 8.0, "{got} {mid}");
    }
}
