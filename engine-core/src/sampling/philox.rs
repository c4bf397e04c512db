//! Philox4x32-10, the counter-based generator CUDA's curand uses.
//!
//! A request's random number for its `n`-th generated token is `philox(key = seed,
//! counter = n)`: a pure function of the request, never of its batch mates or of how many
//! numbers other requests drew. The CUDA sampler uses the same function, so a seeded request
//! draws the same uniforms on every backend.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Ten rounds of Philox4x32 over `counter` with `key`.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let p0 = (M0 as u64) * (c[0] as u64);
        let p1 = (M1 as u64) * (c[2] as u64);
        c = [
            ((p1 >> 32) as u32) ^ c[1] ^ k[0],
            p1 as u32,
            ((p0 >> 32) as u32) ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// A uniform in (0, 1) for the `position`-th draw of the stream keyed by `seed`.
pub fn uniform(seed: u64, position: u64) -> f64 {
    let x = philox4x32_10(
        [position as u32, (position >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    );
    let bits = ((x[0] as u64) << 21) ^ (x[1] as u64 >> 11);
    // 53 random bits, shifted off zero.
    ((bits & ((1 << 53) - 1)) as f64 + 0.5) / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known-answer test vectors from the Random123 distribution (philox4x32_10).
    #[test]
    fn random123_known_answers() {
        assert_eq!(
            philox4x32_10([0, 0, 0, 0], [0, 0]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([0xffffffff; 4], [0xffffffff, 0xffffffff]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn uniform_is_in_range_and_roughly_uniform() {
        let n = 100_000;
        let mut buckets = [0u32; 10];
        for i in 0..n {
            let u = uniform(42, i);
            assert!(u > 0.0 && u < 1.0);
            buckets[(u * 10.0) as usize] += 1;
        }
        // Chi-square with 9 degrees of freedom; 27.9 is the 0.001 critical value.
        let expected = n as f64 / 10.0;
        let chi2: f64 = buckets
            .iter()
            .map(|&b| (b as f64 - expected).powi(2) / expected)
            .sum();
        assert!(chi2 < 27.9, "chi2 {chi2}: {buckets:?}");
    }
}
