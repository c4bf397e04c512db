//! Element-wise f32 kernels of the CPU forward pass: RMSNorm, SiLU-and-mul, and the small
//! vector helpers attention uses (matrix products live in `linear`).

/// Hugging Face `LlamaRMSNorm` in f32: `w * (x / sqrt(mean(x²) + eps))`, row by row.
/// `x` and `out` hold whole rows of `w.len()` values.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    debug_assert_eq!(x.len(), out.len());
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        rms_norm_row(xr, w, eps, or);
    }
}

/// One row of [`rms_norm`]; `x` and `out` may not alias, use [`rms_norm_in_place`] for that.
#[inline]
pub fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = inv_rms(x, eps);
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = wi * (xi * inv);
    }
}

/// [`rms_norm`] over consecutive rows of `w.len()` values, in place.
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(w.len()) {
        let inv = inv_rms(row, eps);
        for (xi, &wi) in row.iter_mut().zip(w) {
            *xi = wi * (*xi * inv);
        }
    }
}

#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let sum: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let var = (sum / x.len() as f64) as f32;
    1.0 / (var + eps).sqrt()
}

/// `out[r, i] = silu(gu[r, i]) * gu[r, inter + i]` where each row of `gu` is `[gate | up]`.
pub fn silu_mul(gu: &[f32], inter: usize, out: &mut [f32]) {
    for (g, o) in gu.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
        let (gate, up) = g.split_at(inter);
        for ((o, &a), &b) in o.iter_mut().zip(gate).zip(up) {
            *o = a / (1.0 + (-a).exp()) * b;
        }
    }
}

/// `out[r, i] = gelu_tanh(gu[r, i]) * gu[r, inter + i]` (torch's `gelu(approximate="tanh")`,
/// transformers' `gelu_pytorch_tanh`), rows of `gu` being `[gate | up]`.
pub fn gelu_tanh_mul(gu: &[f32], inter: usize, out: &mut [f32]) {
    const K: f32 = 0.797_884_6; // sqrt(2 / pi)
    for (g, o) in gu.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
        let (gate, up) = g.split_at(inter);
        for ((o, &a), &b) in o.iter_mut().zip(gate).zip(up) {
            let inner = K * (a + 0.044_715 * a * a * a);
            *o = 0.5 * a * (1.0 + inner.tanh()) * b;
        }
    }
}

/// Dot product with 8 independent partial sums (vectorizes).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// `y += a * x`.
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}
