//! Matrix products of the CPU forward pass: `y = x · Wᵀ` through the `gemm` crate, with the
//! weights packed once at load time into the layout gemm streams best.
//!
//! A Hugging Face weight `W` is `[out, in]` row-major. We store `Wᵀ` (`[in, out]`) cut into
//! column panels of `PANEL` outputs, each panel a contiguous `[in, PANEL]` row-major block:
//!
//! ```text
//!   Wᵀ  [k = in, n = out]             packed: panel 0 | panel 1 | ... (last one zero-padded)
//!   +--------+--------+----+          panel p = Wᵀ[:, p*PANEL .. (p+1)*PANEL], k rows of PANEL
//!   | pnl 0  | pnl 1  | .. |
//!   +--------+--------+----+
//! ```
//!
//! Why: gemm wants its (internally transposed) left operand column-major. Row-major `W` makes
//! it repack the whole matrix on every call with a few rows (2-3x slower than a matrix-vector
//! product for decode batches); plain `Wᵀ` needs no repacking but, for a wide matrix like
//! `lm_head` (128k columns), every k step of the kernel jumps a page (TLB misses). Panels are
//! contiguous and already in gemm's order, so decode products stream each weight once.
//!
//! Work split: the products are cut into (row block, panel group) tasks run on rayon, each a
//! sequence of single-threaded gemm calls (one per panel); products too small to pay for
//! threads run on the calling thread.

use gemm::Parallelism;
use rayon::prelude::*;

/// Output columns per panel.
pub const PANEL: usize = 128;
/// Below this many multiply-adds a product runs on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 18;
/// Rows per task when a product has many rows (prefill).
const ROW_BLOCK: usize = 64;

/// `Wᵀ` of a `[n, k]` (out, in) weight, packed in column panels (see the module doc).
pub struct PackedWeight {
    k: usize,
    n: usize,
    data: Vec<f32>,
}

impl PackedWeight {
    /// Packs a row-major `[n, k]` (`[out, in]`) matrix.
    pub fn from_rows(w: &[f32], n: usize, k: usize) -> PackedWeight {
        assert_eq!(w.len(), n * k, "PackedWeight: length of a {n}x{k} matrix");
        let panels = n.div_ceil(PANEL);
        let mut data = vec![0.0f32; panels * PANEL * k];
        data.par_chunks_mut(PANEL * k)
            .enumerate()
            .for_each(|(p, panel)| {
                let j0 = p * PANEL;
                for j in j0..(j0 + PANEL).min(n) {
                    let row = &w[j * k..(j + 1) * k];
                    for (i, &v) in row.iter().enumerate() {
                        panel[i * PANEL + (j - j0)] = v;
                    }
                }
            });
        PackedWeight { k, n, data }
    }

    /// `W[j, :]` (row `j` of the original matrix), e.g. an embedding row of a tied `lm_head`.
    pub fn row_into(&self, j: usize, out: &mut [f32]) {
        let panel = &self.data[(j / PANEL) * PANEL * self.k..][..PANEL * self.k];
        let c = j % PANEL;
        for (i, o) in out[..self.k].iter_mut().enumerate() {
            *o = panel[i * PANEL + c];
        }
    }
}

/// `y[m, n] = x[m, k] · Wᵀ`, or `y += ...` when `accumulate`.
pub fn linear(x: &[f32], w: &PackedWeight, y: &mut [f32], m: usize, accumulate: bool) {
    let (k, n) = (w.k, w.n);
    assert!(x.len() >= m * k, "linear: x has {} < {m}x{k}", x.len());
    assert!(y.len() >= m * n, "linear: y has {} < {m}x{n}", y.len());
    if m == 0 || n == 0 {
        return;
    }
    let panels = n.div_ceil(PANEL);
    let threads = rayon::current_num_threads();
    if m * n * k < PARALLEL_MIN_WORK || threads == 1 {
        // SAFETY: rows 0..m and panels 0..panels are in bounds (asserted above; the packed
        // data holds `panels` full panels); y does not alias x or the weights.
        unsafe { run_block(x, w, y.as_mut_ptr(), 0..m, 0..panels, accumulate) };
        return;
    }
    let row_blocks = if m <= 16 { 1 } else { m.div_ceil(ROW_BLOCK) };
    let rows_per = m.div_ceil(row_blocks);
    let groups = (threads * 4).div_ceil(row_blocks).clamp(1, panels);
    let panels_per = panels.div_ceil(groups);
    let y_addr = y.as_mut_ptr() as usize;
    (0..row_blocks * groups).into_par_iter().for_each(|t| {
        let (rb, g) = (t / groups, t % groups);
        let rows = rb * rows_per..((rb + 1) * rows_per).min(m);
        let pans = g * panels_per..((g + 1) * panels_per).min(panels);
        // SAFETY: tasks cover disjoint (row range x panel range) blocks of y, so no element
        // of y is written by two threads; bounds as in the sequential case.
        unsafe { run_block(x, w, y_addr as *mut f32, rows, pans, accumulate) };
    });
}

/// The block `rows x panels` of the product, one gemm call per panel.
///
/// # Safety
/// `y` must be valid for writes of the `m x n` output (row stride `n`) over `rows`, with no
/// other thread writing the same block; `rows` within `x`'s rows; `panels` within `w`'s.
unsafe fn run_block(
    x: &[f32],
    w: &PackedWeight,
    y: *mut f32,
    rows: std::ops::Range<usize>,
    panels: std::ops::Range<usize>,
    accumulate: bool,
) {
    let (k, n) = (w.k, w.n);
    if rows.is_empty() {
        return;
    }
    let m = rows.len();
    let x = &x[rows.start * k..rows.end * k];
    for p in panels {
        let j0 = p * PANEL;
        let nc = PANEL.min(n - j0);
        let panel = &w.data[p * PANEL * k..(p + 1) * PANEL * k];
        // SAFETY: gemm's argument order is (m, n, k, dst, dst_cs, dst_rs, read_dst, lhs,
        // lhs_cs, lhs_rs, rhs, rhs_cs, rhs_rs, alpha, beta, conj_dst, conj_lhs, conj_rhs,
        // parallelism), dst = alpha*dst + beta*lhs*rhs. dst = y[rows, j0..j0+nc] (row stride
        // n, in bounds per the caller); lhs = x rows (m x k, row stride k, bounds from the
        // slice); rhs = the panel (k x nc, row stride PANEL, nc <= PANEL, slice bounds).
        unsafe {
            gemm::gemm(
                m,
                nc,
                k,
                y.add(rows.start * n + j0),
                1,
                n as isize,
                accumulate,
                x.as_ptr(),
                1,
                k as isize,
                panel.as_ptr(),
                1,
                PANEL as isize,
                1.0f32,
                1.0f32,
                false,
                false,
                false,
                Parallelism::None,
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut y = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k)
                    .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                    .sum::<f64>() as f32;
            }
        }
        y
    }

    #[test]
    fn linear_matches_naive_in_all_regimes() {
        let mut seed = 1u64;
        let mut rnd = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        for &(m, k, n) in &[
            (1, 8, 5),
            (3, 64, 70),
            (1, 256, 4000),
            (5, 128, 1000),
            (40, 96, 200),
            (150, 64, 300),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| rnd()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rnd()).collect();
            let want = naive(&x, &w, m, k, n);
            let pw = PackedWeight::from_rows(&w, n, k);
            let mut y = vec![1.0; m * n];
            linear(&x, &pw, &mut y, m, false);
            for (a, b) in y.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "{m}x{k}x{n}: {a} vs {b}");
            }
            linear(&x, &pw, &mut y, m, true);
            for (a, b) in y.iter().zip(&want) {
                assert!(
                    (a - 2.0 * b).abs() < 2e-4,
                    "accumulate {m}x{k}x{n}: {a} vs {b}"
                );
            }
            let mut row = vec![0.0; k];
            pw.row_into(n - 1, &mut row);
            assert_eq!(row, w[(n - 1) * k..]);
        }
    }

    /// `cargo test --release -p harrier-engine-core --lib -- linear::tests::timings --ignored --nocapture`
    #[test]
    #[ignore = "timing"]
    fn timings() {
        for &(k, n) in &[(256usize, 128256usize), (256, 1536), (768, 256)] {
            let w = PackedWeight::from_rows(&vec![0.01f32; n * k], n, k);
            for m in [1usize, 2, 8, 16, 64] {
                let x = vec![0.5f32; m * k];
                let mut y = vec![0.0f32; m * n];
                linear(&x, &w, &mut y, m, false);
                let reps = 20;
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    linear(&x, &w, &mut y, m, false);
                }
                let dt = t.elapsed().as_secs_f64() / reps as f64;
                let gflops = 2.0 * (m * n * k) as f64 / dt / 1e9;
                eprintln!("k {k} n {n} m {m}: {:.3} ms, {gflops:.1} GFLOP/s", dt * 1e3);
            }
        }
    }
}
