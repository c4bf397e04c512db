//! Captured decode graphs (reference 001, 002): one CUDA graph per (ping-pong slot, bucket
//! size), each a FULL decode step from the embedding to the logits, attention included.
//!
//! A graph is captured over fixed addresses: the slot's metadata buffer, the per-row block
//! tables, the rows' pending tokens, the activations, the KV cache and the logits. Replay only
//! refills the slot's metadata. Sampling is not in the graph: it runs after the replay on the
//! same stream with the real number of rows (reference 000 §4.2), so host-side masks and
//! penalties still finalize after the previous step's commit.
//!
//! None of our graphs allocates: every buffer is persistent, so the graphs share one "pool"
//! (the activation buffers) and cost only the driver's own memory for the instantiated graphs,
//! which start-up measures and logs.

use harrier_kernels::cudarc::driver::{result as dr, sys};

use super::ck;

/// The device addresses a graph was captured over. Replays must see the same ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GraphAddrs {
    pub meta: u64,
    pub row_block_tables: u64,
    pub pending: u64,
    pub logits: u64,
}

/// One instantiated graph: a decode step of `size` rows on one slot.
pub(crate) struct DecodeGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    pub size: usize,
    pub addrs: GraphAddrs,
    /// Nodes of the captured graph: its kernel launches (our graphs hold nothing else).
    pub nodes: usize,
}

impl DecodeGraph {
    /// Captures what `body` enqueues on `stream` and instantiates it. The capture is ended
    /// even when `body` fails, so the stream is usable (or at least not left capturing).
    ///
    /// # Safety
    /// `stream` must be a live stream of the current context; `body` must enqueue only work
    /// that is legal under capture (kernel launches, no synchronisation, no allocation).
    pub unsafe fn capture(
        stream: sys::CUstream,
        size: usize,
        addrs: GraphAddrs,
        body: impl FnOnce() -> anyhow::Result<()>,
    ) -> anyhow::Result<DecodeGraph> {
        // SAFETY: caller's contract; THREAD_LOCAL: other threads' CUDA calls are not affected.
        unsafe {
            ck(
                dr::stream::begin_capture(
                    stream,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                ),
                "cuStreamBeginCapture",
            )?;
            let enqueued = body();
            let ended = ck(dr::stream::end_capture(stream), "cuStreamEndCapture");
            enqueued?;
            let graph = ended?;
            let exec = match dr::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) {
                Ok(e) => e,
                Err(e) => {
                    let _ = dr::graph::destroy(graph);
                    anyhow::bail!("CUDA error in cuGraphInstantiate: {e:?}");
                }
            };
            let mut nodes = 0usize;
            let counted = ck(
                sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut nodes).result(),
                "cuGraphGetNodes",
            );
            let g = DecodeGraph {
                graph,
                exec,
                size,
                addrs,
                nodes,
            };
            counted?;
            ck(dr::graph::upload(exec, stream), "cuGraphUpload")?;
            Ok(g)
        }
    }

    /// Enqueues one replay on `stream`.
    ///
    /// # Safety
    /// The slot's metadata must hold a step of `size` rows (padding included); the buffers at
    /// `addrs` must still be alive (debug builds assert the caller's view of them).
    pub unsafe fn replay(
        &self,
        stream: sys::CUstream,
        size: usize,
        now: GraphAddrs,
    ) -> anyhow::Result<()> {
        debug_assert_eq!(self.size, size, "replay of the wrong bucket");
        debug_assert_eq!(
            self.addrs, now,
            "a graph replay must see the addresses it was captured over"
        );
        // SAFETY: caller's contract.
        ck(
            unsafe { dr::graph::launch(self.exec, stream) },
            "cuGraphLaunch",
        )
    }
}

impl Drop for DecodeGraph {
    fn drop(&mut self) {
        // SAFETY: created in `capture`, destroyed once; callers synchronise before dropping.
        unsafe {
            let _ = dr::graph::exec_destroy(self.exec);
            let _ = dr::graph::destroy(self.graph);
        }
    }
}
