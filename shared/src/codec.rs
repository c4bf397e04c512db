//! MessagePack encoding of the wire messages (rmp-serde).
//!
//! Every ZeroMQ payload frame holds exactly one [`FrontendMessage`] or [`EngineMessage`]
//! encoded with [`encode`] and read back with [`decode`]. Structs are written compactly as
//! MessagePack arrays (field order matters; field names are not on the wire) and enum
//! variants by name (`{"Request": [...]}`, a bare `"Heartbeat"` for unit variants).
//! Changing field order or variant names is therefore an incompatible change: bump
//! [`crate::protocol::PROTOCOL_VERSION`].
//!
//! [`decode`] never panics on malformed input and rejects empty frames and frames with bytes
//! left over after the message. A claimed length costs at most what the frame holds: strings
//! and byte arrays are read from the frame, and serde preallocates a sequence for at most
//! 1 MiB whatever length it claims. Nesting is capped at [`MAX_DEPTH`] arrays and maps, well
//! above what the protocol needs (8) and far below what overflows a 2 MiB thread stack in a debug
//! build (rmp-serde's default of 1024 levels did, in fields the decoder skips).
//!
//! [`FrontendMessage`]: crate::protocol::FrontendMessage
//! [`EngineMessage`]: crate::protocol::EngineMessage

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Why a message could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The message could not be serialized (should not happen for the protocol types).
    #[error("failed to encode message: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
    /// The frame is not a valid MessagePack encoding of the expected type.
    #[error("failed to decode {len}-byte frame: {source}")]
    Decode {
        /// Length of the offending frame.
        len: usize,
        /// What rmp-serde reported.
        #[source]
        source: rmp_serde::decode::Error,
    },
    /// The frame was empty.
    #[error("empty frame")]
    Empty,
    /// A valid message was followed by extra bytes.
    #[error("{trailing} trailing bytes after the message in a {len}-byte frame")]
    TrailingBytes {
        /// Length of the frame.
        len: usize,
        /// Bytes left after the message.
        trailing: usize,
    },
}

/// rmp-serde's nesting limit for [`decode`]: fewer than this many arrays and maps deep. The
/// protocol's deepest path (`Outputs` -> outputs -> output -> logprobs -> entry -> top -> pair)
/// decodes with a limit of 8.
pub const MAX_DEPTH: usize = 32;

/// Encodes one message into a frame payload.
pub fn encode<T: Serialize>(msg: &T) -> Result<Bytes, CodecError> {
    Ok(Bytes::from(rmp_serde::to_vec(msg)?))
}

/// Decodes one frame payload into a message; any malformation is an `Err`, never a panic.
pub fn decode<T: DeserializeOwned>(frame: &[u8]) -> Result<T, CodecError> {
    if frame.is_empty() {
        return Err(CodecError::Empty);
    }
    let len = frame.len();
    // `Deserializer::new` over `&[u8]` advances the slice as it reads, so what is left
    // afterwards is exactly the unconsumed tail.
    let mut de = rmp_serde::Deserializer::new(frame);
    de.set_max_depth(MAX_DEPTH);
    let msg = T::deserialize(&mut de).map_err(|source| CodecError::Decode { len, source })?;
    let trailing = de.get_ref().len();
    if trailing != 0 {
        return Err(CodecError::TrailingBytes { len, trailing });
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::*;

    fn stats() -> EngineStats {
        EngineStats {
            num_running: 3,
            num_waiting: 4,
            kv_blocks_used: 5,
            kv_blocks_total: 600,
            sliding_kv_blocks_used: 6,
            sliding_kv_blocks_total: 60,
            last_step_us: 7_000,
            steps_total: 8,
            preemptions_total: 9,
            prefix_cache_queries_total: 10,
            prefix_cache_hits_total: 11,
            prompt_tokens_total: 12,
            generation_tokens_total: u64::MAX,
            graph_replays_total: 13,
            eager_decode_steps_total: 14,
            spec_drafts_total: 15,
            spec_draft_tokens_total: 16,
            spec_accepted_tokens_total: 17,
            spec_accepted_per_pos_total: [18; MAX_SPECULATIVE_TOKENS],
        }
    }

    fn sampling() -> SamplingParams {
        SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            top_k: Some(40),
            min_p: 0.05,
            seed: Some(u64::MAX - 1),
            presence_penalty: -1.5,
            frequency_penalty: 0.25,
            repetition_penalty: 1.1,
            max_tokens: 128,
            min_tokens: 2,
            stop_token_ids: vec![7, 8, u32::MAX],
            ignore_eos: true,
            logprobs: Some(5),
            logit_bias: vec![(3, -100.0), (u32::MAX, 2.5)],
            structured: Some(Box::new(StructuredOutput::Choice(vec![
                "a".into(),
                "é".into(),
            ]))),
        }
    }

    fn engine_info() -> EngineInfo {
        EngineInfo {
            protocol_version: PROTOCOL_VERSION,
            engine_version: "0.1.0-test".into(),
            model_name: "llama-tiny ünïcode".into(),
            max_model_len: 4096,
            vocab_size: 128_256,
            eos_token_ids: vec![128_001, 128_009],
            limits: EngineLimits {
                max_num_seqs: 256,
                max_num_batched_tokens: 8192,
                max_logprobs: 20,
                block_size: 16,
                num_kv_blocks: 12_345,
                num_speculative_tokens: 0,
            },
        }
    }

    /// Every `FrontendMessage` variant, every field non-default.
    pub(crate) fn all_frontend_messages() -> Vec<FrontendMessage> {
        vec![
            FrontendMessage::Hello(Hello {
                protocol_version: 42,
                name: "frontend-0/pid-1".into(),
            }),
            FrontendMessage::Request(EngineCoreRequest {
                request_id: "cmpl-abc".into(),
                prompt_token_ids: vec![1, 2, 3, u32::MAX],
                sampling: sampling(),
                arrival_time: 1_700_000_000.125,
                cache_salt: Some("tenant-7".into()),
            }),
            FrontendMessage::Abort(Abort {
                request_ids: vec!["a".into(), "b".into()],
            }),
            FrontendMessage::Utility(UtilityRequest {
                call_id: 99,
                call: UtilityCall::Health,
            }),
            FrontendMessage::Utility(UtilityRequest {
                call_id: 100,
                call: UtilityCall::Stats,
            }),
            FrontendMessage::Heartbeat,
            FrontendMessage::Goodbye,
        ]
    }

    /// Every `EngineMessage` variant (and every nested enum variant), every field non-default.
    pub(crate) fn all_engine_messages() -> Vec<EngineMessage> {
        let output = |reason, message: Option<&str>| RequestOutput {
            request_id: format!("req-{reason:?}"),
            new_token_ids: vec![10, 11],
            logprobs: Some(vec![TokenLogprobs {
                token_id: 10,
                logprob: -0.5,
                rank: 2,
                top: vec![(9, -0.25), (10, -0.5)],
            }]),
            finish: Some(Finish {
                reason,
                stop_token: Some(11),
                message: message.map(str::to_owned),
                timing: None,
                spec: None,
            }),
            num_cached_tokens: Some(32),
        };
        vec![
            EngineMessage::Welcome(engine_info()),
            EngineMessage::Rejected(Rejected {
                engine_protocol_version: 7,
                reason: "too old".into(),
            }),
            EngineMessage::Outputs(EngineCoreOutputs {
                step: 1234,
                outputs: vec![
                    output(FinishReason::Stop, None),
                    output(FinishReason::Length, None),
                    output(FinishReason::Abort, None),
                    output(FinishReason::Error, Some("device lost")),
                    RequestOutput {
                        request_id: "running".into(),
                        new_token_ids: vec![5],
                        logprobs: None,
                        finish: None,
                        num_cached_tokens: None,
                    },
                ],
                stats: stats(),
            }),
            EngineMessage::UtilityReply(UtilityReply {
                call_id: 1,
                result: UtilityResult::Health { healthy: true },
            }),
            EngineMessage::UtilityReply(UtilityReply {
                call_id: 2,
                result: UtilityResult::Stats(Box::new(stats())),
            }),
            EngineMessage::UtilityReply(UtilityReply {
                call_id: 3,
                result: UtilityResult::Error("boom".into()),
            }),
            EngineMessage::Heartbeat(stats()),
        ]
    }

    #[test]
    fn round_trip_every_frontend_message() {
        let msgs = all_frontend_messages();
        // Make sure the list stays exhaustive when variants are added.
        for m in &msgs {
            match m {
                FrontendMessage::Hello(_)
                | FrontendMessage::Request(_)
                | FrontendMessage::Abort(_)
                | FrontendMessage::Utility(_)
                | FrontendMessage::Heartbeat
                | FrontendMessage::Goodbye => {}
            }
        }
        for msg in msgs {
            let frame = encode(&msg).unwrap();
            let back: FrontendMessage = decode(&frame).unwrap();
            assert_eq!(back, msg);
        }
    }

    #[test]
    fn round_trip_every_engine_message() {
        let msgs = all_engine_messages();
        for m in &msgs {
            match m {
                EngineMessage::Welcome(_)
                | EngineMessage::Rejected(_)
                | EngineMessage::Outputs(_)
                | EngineMessage::UtilityReply(_)
                | EngineMessage::Heartbeat(_) => {}
            }
        }
        for msg in msgs {
            let frame = encode(&msg).unwrap();
            let back: EngineMessage = decode(&frame).unwrap();
            assert_eq!(back, msg);
        }
    }

    #[test]
    fn empty_frame_is_an_error() {
        assert!(matches!(
            decode::<FrontendMessage>(&[]),
            Err(CodecError::Empty)
        ));
        assert!(matches!(
            decode::<EngineMessage>(&[]),
            Err(CodecError::Empty)
        ));
    }

    #[test]
    fn garbage_is_an_error() {
        for garbage in [
            &b"\xc1"[..],
            b"hello world",
            b"\xff\xff\xff\xff",
            b"\x93\x01\x02",
        ] {
            assert!(decode::<FrontendMessage>(garbage).is_err(), "{garbage:?}");
            assert!(decode::<EngineMessage>(garbage).is_err(), "{garbage:?}");
        }
    }

    #[test]
    fn every_truncation_is_an_error() {
        for msg in all_frontend_messages() {
            let frame = encode(&msg).unwrap();
            for cut in 0..frame.len() {
                assert!(
                    decode::<FrontendMessage>(&frame[..cut]).is_err(),
                    "{msg:?} cut at {cut}"
                );
            }
        }
        for msg in all_engine_messages() {
            let frame = encode(&msg).unwrap();
            for cut in 0..frame.len() {
                assert!(
                    decode::<EngineMessage>(&frame[..cut]).is_err(),
                    "{msg:?} cut at {cut}"
                );
            }
        }
    }

    #[test]
    fn trailing_bytes_are_an_error() {
        let mut frame = encode(&FrontendMessage::Heartbeat).unwrap().to_vec();
        frame.push(0);
        assert!(matches!(
            decode::<FrontendMessage>(&frame),
            Err(CodecError::TrailingBytes { trailing: 1, .. })
        ));
    }

    #[test]
    fn unknown_variants_are_errors() {
        // Unit variant by index and by name.
        assert!(decode::<FrontendMessage>(&rmp_serde::to_vec(&99u32).unwrap()).is_err());
        assert!(decode::<FrontendMessage>(&rmp_serde::to_vec("Bogus").unwrap()).is_err());
        // Newtype variant {index: payload} and {name: payload}.
        let by_index: std::collections::BTreeMap<u32, u32> = [(99, 1)].into();
        assert!(decode::<FrontendMessage>(&rmp_serde::to_vec(&by_index).unwrap()).is_err());
        assert!(decode::<EngineMessage>(&rmp_serde::to_vec(&by_index).unwrap()).is_err());
        let by_name: std::collections::BTreeMap<&str, u32> = [("Bogus", 1)].into();
        assert!(decode::<EngineMessage>(&rmp_serde::to_vec(&by_name).unwrap()).is_err());
        // A known variant with the wrong payload shape.
        let wrong: std::collections::BTreeMap<&str, &str> = [("Hello", "x")].into();
        assert!(decode::<FrontendMessage>(&rmp_serde::to_vec(&wrong).unwrap()).is_err());
    }

    #[test]
    fn message_of_the_other_direction_is_an_error() {
        let frame = encode(&EngineMessage::Heartbeat(stats())).unwrap();
        assert!(decode::<FrontendMessage>(&frame).is_err());
    }

    /// Found by the fuzz harness: 1,000 nested arrays in a field the decoder skips overflowed
    /// a 2 MiB stack in a debug build (rmp-serde's default depth limit is 1024).
    #[test]
    fn deep_nesting_is_an_error_within_a_small_stack() {
        let mut frame = b"\x81\xa5Hello\x81\xa1x".to_vec();
        frame.extend(std::iter::repeat_n(0x91, 10_000));
        frame.push(0xc0);
        let result = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || decode::<FrontendMessage>(&frame).map(|_| ()))
            .unwrap()
            .join()
            .expect("no stack overflow");
        assert!(
            matches!(
                result,
                Err(CodecError::Decode {
                    source: rmp_serde::decode::Error::DepthLimitExceeded,
                    ..
                })
            ),
            "{result:?}"
        );
    }

    #[test]
    fn huge_claimed_lengths_do_not_allocate_or_panic() {
        // array32 / str32 / map32 headers claiming ~4 billion elements.
        for frame in [
            &b"\xdd\xff\xff\xff\xff"[..],
            b"\xdb\xff\xff\xff\xffabc",
            b"\xdf\xff\xff\xff\xff\xa5Hello",
            b"\x81\xa7Request\xdd\xff\xff\xff\xff",
        ] {
            assert!(decode::<FrontendMessage>(frame).is_err());
        }
    }
}

#[cfg(test)]
mod fuzz_tests;
