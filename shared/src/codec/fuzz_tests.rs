//! Fuzz harness of the frame decoder (docs/fuzzing.md): arbitrary bytes, and every valid
//! message mutated (bytes flipped, inserted, deleted, frames spliced, length prefixes claiming
//! up to 4 GiB), decoded as both directions' messages. Every frame must decode or fail with a
//! `CodecError`: no panic, no hang (the watchdog), and no allocation past [`alloc_bound`].
//! Whatever decodes must re-encode to a frame that decodes to the same bytes again.

use proptest::prelude::*;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::tests::{all_engine_messages, all_frontend_messages};
use super::*;
use crate::fuzz;
use crate::protocol::{EngineMessage, FrontendMessage};

/// The largest single allocation decoding a `len`-byte frame may make. serde preallocates a
/// sequence for at most 1 MiB whatever length the frame claims (`size_hint::cautious`), and
/// strings and byte arrays are read from the frame, so never longer than it.
fn alloc_bound(len: usize) -> usize {
    (1 << 20) + 4 * len + 4096
}

/// Decodes `frame` as both message types: no panic, a bounded allocation, a stable re-encoding.
fn check_frame(frame: &[u8]) -> Result<(), TestCaseError> {
    let _watch = fuzz::watch("codec", &frame);
    check_as::<FrontendMessage>(frame)?;
    check_as::<EngineMessage>(frame)
}

fn check_as<T: DeserializeOwned + Serialize>(frame: &[u8]) -> Result<(), TestCaseError> {
    let (result, largest) = fuzz::largest_allocation(|| decode::<T>(frame));
    prop_assert!(
        largest <= alloc_bound(frame.len()),
        "decoding a {}-byte frame allocated {largest} bytes at once",
        frame.len()
    );
    match result {
        Ok(msg) => {
            // Accepted: the message's own encoding is a fixed point (floats compared as bytes,
            // so NaN payloads count as equal).
            let again = encode(&msg).expect("a decoded message encodes");
            let back: T = decode(&again).expect("a re-encoded message decodes");
            prop_assert_eq!(encode(&back).expect("encodes"), again);
        }
        Err(e) => {
            // The error renders (Display walks rmp-serde's message).
            prop_assert!(!e.to_string().is_empty());
        }
    }
    Ok(())
}

/// Every valid frame of both directions.
fn valid_frames() -> Vec<Vec<u8>> {
    let mut frames: Vec<Vec<u8>> = all_frontend_messages()
        .iter()
        .map(|m| encode(m).unwrap().to_vec())
        .collect();
    frames.extend(
        all_engine_messages()
            .iter()
            .map(|m| encode(m).unwrap().to_vec()),
    );
    frames
}

/// MessagePack headers that claim a length: (marker, width of the length field in bytes).
const LENGTH_MARKERS: [(u8, usize); 12] = [
    (0xdc, 2), // array 16
    (0xdd, 4), // array 32
    (0xde, 2), // map 16
    (0xdf, 4), // map 32
    (0xd9, 1), // str 8
    (0xda, 2), // str 16
    (0xdb, 4), // str 32
    (0xc4, 1), // bin 8
    (0xc5, 2), // bin 16
    (0xc6, 4), // bin 32
    (0xc8, 2), // ext 16 (followed by a type byte)
    (0xc9, 4), // ext 32
];

/// One edit of a valid frame.
#[derive(Debug, Clone)]
enum Mutation {
    /// Overwrite the byte at (position mod len).
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    Truncate(usize),
    /// Write a length header (LENGTH_MARKERS[k]) claiming `claim` at the position.
    Length(usize, usize, u32),
    /// Replace the tail from the position with another frame's tail from its position.
    Splice(usize, usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let claim = prop_oneof![
        Just(u32::MAX),
        Just(u32::MAX - 1),
        Just(1 << 31),
        Just(u32::from(u16::MAX)),
        Just(0),
        0u32..64,
        any::<u32>(),
    ];
    prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Mutation::Set(p, b)),
        2 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..6))
            .prop_map(|(p, b)| Mutation::Insert(p, b)),
        2 => (any::<usize>(), 1usize..8).prop_map(|(p, n)| Mutation::Delete(p, n)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
        3 => (any::<usize>(), 0..LENGTH_MARKERS.len(), claim)
            .prop_map(|(p, k, c)| Mutation::Length(p, k, c)),
        1 => (any::<usize>(), any::<usize>(), any::<usize>())
            .prop_map(|(p, f, q)| Mutation::Splice(p, f, q)),
    ]
}

fn apply(frame: &mut Vec<u8>, m: &Mutation, frames: &[Vec<u8>]) {
    let at = |p: usize, len: usize| if len == 0 { 0 } else { p % len };
    match m {
        Mutation::Set(p, b) => {
            if !frame.is_empty() {
                let i = at(*p, frame.len());
                frame[i] = *b;
            }
        }
        Mutation::Insert(p, bytes) => {
            let i = at(*p, frame.len() + 1);
            frame.splice(i..i, bytes.iter().copied());
        }
        Mutation::Delete(p, n) => {
            let i = at(*p, frame.len());
            let end = (i + n).min(frame.len());
            frame.drain(i..end);
        }
        Mutation::Truncate(n) => {
            let n = at(*n, frame.len() + 1);
            frame.truncate(n);
        }
        Mutation::Length(p, k, claim) => {
            let (marker, width) = LENGTH_MARKERS[*k];
            let mut header = vec![marker];
            header.extend_from_slice(&claim.to_be_bytes()[4 - width..]);
            let i = at(*p, frame.len() + 1);
            let end = (i + header.len()).min(frame.len());
            frame.splice(i..end, header);
        }
        Mutation::Splice(p, f, q) => {
            let other = &frames[f % frames.len()];
            let i = at(*p, frame.len() + 1);
            let j = at(*q, other.len() + 1);
            frame.truncate(i);
            frame.extend_from_slice(&other[j..]);
        }
    }
}

proptest! {
    #![proptest_config(fuzz::config(16_384))]

    /// Arbitrary bytes, some opened with a map or array header so the decoder goes deeper.
    #[test]
    fn fuzz_decode_arbitrary_bytes(
        head in prop_oneof![Just(vec![]), Just(vec![0x81]), Just(vec![0x81, 0xa7]), Just(vec![0x92])],
        bytes in proptest::collection::vec(any::<u8>(), 0..600),
    ) {
        let frame = [head, bytes].concat();
        check_frame(&frame)?;
    }

    /// Every valid frame, mutated a few times.
    #[test]
    fn fuzz_decode_mutated_frames(
        idx in any::<usize>(),
        mutations in proptest::collection::vec(mutation(), 1..6),
    ) {
        let frames = valid_frames();
        let mut frame = frames[idx % frames.len()].clone();
        for m in &mutations {
            apply(&mut frame, m, &frames);
        }
        check_frame(&frame)?;
    }
}

/// Nesting far past rmp-serde's depth limit (1024) in a field the decoder skips: an error, not
/// a stack overflow, even on a 2 MiB test thread in a debug build.
#[test]
fn fuzz_regression_deep_nesting_in_a_skipped_field() {
    for open in [0x91u8, 0x81] {
        let mut frame = vec![0x81, 0xa5];
        frame.extend_from_slice(b"Hello");
        // Hello as a map with one unknown key whose value nests 100,000 deep.
        frame.extend_from_slice(&[0x81, 0xa1, b'x']);
        for _ in 0..100_000 {
            frame.push(open);
            if open == 0x81 {
                frame.push(0x00); // key 0, then the nested value
            }
        }
        frame.push(0xc0);
        check_frame(&frame).unwrap();
        assert!(decode::<FrontendMessage>(&frame).is_err());
    }
}

/// A length prefix claiming 4 GiB in every position of every valid frame.
#[test]
fn fuzz_regression_every_length_claim_everywhere() {
    let frames = valid_frames();
    for frame in &frames {
        for pos in 0..frame.len() {
            for k in 0..LENGTH_MARKERS.len() {
                let mut f = frame.clone();
                apply(&mut f, &Mutation::Length(pos, k, u32::MAX), &frames);
                check_frame(&f).unwrap();
            }
        }
    }
}
