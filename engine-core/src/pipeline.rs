//! The in-flight state machine of the engine loop (reference 000 §4.6 and §5 Phase 2).
//!
//! ```text
//!   launch ──► launch_handle ──finalize──► batch_queue (newest … oldest) ──pop_oldest──► committing ──completed──► slot free
//!              (forward enqueued,          (sampling + D2H enqueued)                    (host reads
//!               not yet sampled)                                                          outputs)
//! ```
//!
//! - At most `depth` steps are in flight (`launch_handle` + `batch_queue` + `committing`); depth 2
//!   is the async pipeline, depth 1 the synchronous loop.
//! - Each in-flight step owns one of two ping-pong slots (a bitmask); a slot is free again only
//!   after the host finished committing the step (I6), not merely when its copy is done.
//! - Completion is FIFO: the oldest sampled step is always committed first (I2).
//!
//! Pure bookkeeping: no backend, no request state. Reference counts on requests (I4) are the
//! scheduler's business; this type never touches them.

use std::collections::VecDeque;

/// One of the two ping-pong slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotId(pub u8);

pub const NUM_SLOTS: usize = 2;

/// Anything that occupies a slot (a launch handle or an in-flight step).
pub trait SlotOwner {
    fn slot(&self) -> SlotId;
}

#[derive(Debug)]
pub struct PipelineState<L, S> {
    depth: usize,
    launch_handle: Option<L>,
    /// Front: newest; back: oldest.
    batch_queue: VecDeque<S>,
    committing: Option<SlotId>,
    slots_in_use: u8,
}

impl<L: SlotOwner, S: SlotOwner> PipelineState<L, S> {
    /// `depth`: 1 (synchronous) or 2 (async).
    pub fn new(depth: usize) -> Self {
        assert!(
            (1..=NUM_SLOTS).contains(&depth),
            "pipeline depth must be 1 or 2"
        );
        Self {
            depth,
            launch_handle: None,
            batch_queue: VecDeque::with_capacity(NUM_SLOTS),
            committing: None,
            slots_in_use: 0,
        }
    }

    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Steps in flight: launched, sampled-and-queued, or being committed.
    pub fn in_flight(&self) -> usize {
        self.launch_handle.is_some() as usize
            + self.batch_queue.len()
            + self.committing.is_some() as usize
    }

    /// Nothing launched, queued or being committed.
    pub fn is_drained(&self) -> bool {
        self.in_flight() == 0
    }

    pub fn has_launch(&self) -> bool {
        self.launch_handle.is_some()
    }

    pub fn queued(&self) -> usize {
        self.batch_queue.len()
    }

    /// A slot a new step may use, if the depth allows another step in flight.
    pub fn free_slot(&self) -> Option<SlotId> {
        if self.in_flight() >= self.depth || self.launch_handle.is_some() {
            return None;
        }
        (0..NUM_SLOTS as u8)
            .find(|s| self.slots_in_use & (1 << s) == 0)
            .map(SlotId)
    }

    pub fn on_launch(&mut self, handle: L) {
        let slot = handle.slot();
        assert!(
            self.launch_handle.is_none(),
            "a forward is already awaiting sampling"
        );
        assert!(self.in_flight() < self.depth, "pipeline full");
        assert_eq!(self.slots_in_use & (1 << slot.0), 0, "{slot:?} is in use");
        self.slots_in_use |= 1 << slot.0;
        self.launch_handle = Some(handle);
    }

    /// Takes the launched forward to finalize its sampling; the slot stays in use.
    pub fn take_launch(&mut self) -> Option<L> {
        self.launch_handle.take()
    }

    /// Queues the sampled step made from the handle just taken.
    pub fn on_pending_commit(&mut self, step: S) {
        let slot = step.slot();
        assert!(
            self.slots_in_use & (1 << slot.0) != 0,
            "{slot:?} was not launched"
        );
        assert!(
            self.batch_queue.iter().all(|s| s.slot() != slot),
            "{slot:?} queued twice"
        );
        self.batch_queue.push_front(step);
    }

    /// Hands out the oldest sampled step (FIFO, I2); its slot stays in use until
    /// [`Self::on_step_completed`] (I6).
    pub fn pop_oldest(&mut self) -> Option<S> {
        assert!(self.committing.is_none(), "previous step not completed");
        let step = self.batch_queue.pop_back()?;
        self.committing = Some(step.slot());
        Some(step)
    }

    /// The host finished committing the step handed out by [`Self::pop_oldest`].
    pub fn on_step_completed(&mut self) {
        let slot = self.committing.take().expect("no step being committed");
        self.slots_in_use &= !(1 << slot.0);
    }

    /// Forgets everything (engine-fatal path only: the backend is being torn down).
    pub fn clear(&mut self) {
        self.launch_handle = None;
        self.batch_queue.clear();
        self.committing = None;
        self.slots_in_use = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, PartialEq)]
    struct H(SlotId, u32);
    impl SlotOwner for H {
        fn slot(&self) -> SlotId {
            self.0
        }
    }
    type P = PipelineState<H, H>;

    #[test]
    fn ping_pong_fifo() {
        let mut p = P::new(2);
        let s0 = p.free_slot().unwrap();
        p.on_launch(H(s0, 0));
        assert_eq!(
            p.free_slot(),
            None,
            "no second launch before sampling the first"
        );
        let h = p.take_launch().unwrap();
        p.on_pending_commit(h);
        let s1 = p.free_slot().unwrap();
        assert_ne!(s0, s1);
        p.on_launch(H(s1, 1));
        let h = p.take_launch().unwrap();
        p.on_pending_commit(h);
        assert_eq!(p.free_slot(), None, "both slots busy");
        assert_eq!(p.pop_oldest(), Some(H(s0, 0)), "oldest first");
        assert_eq!(p.free_slot(), None, "slot stays busy while committing (I6)");
        p.on_step_completed();
        assert_eq!(p.free_slot(), Some(s0));
        assert_eq!(p.pop_oldest(), Some(H(s1, 1)));
        p.on_step_completed();
        assert!(p.is_drained());
    }

    #[test]
    fn sync_depth_allows_one_step() {
        let mut p = P::new(1);
        let s = p.free_slot().unwrap();
        p.on_launch(H(s, 0));
        let h = p.take_launch().unwrap();
        p.on_pending_commit(h);
        assert_eq!(p.free_slot(), None);
        p.pop_oldest().unwrap();
        assert_eq!(p.free_slot(), None);
        p.on_step_completed();
        assert!(p.free_slot().is_some());
    }

    #[test]
    #[should_panic(expected = "in use")]
    fn launching_on_busy_slot_panics() {
        let mut p = P::new(2);
        p.on_launch(H(SlotId(0), 0));
        let h = p.take_launch().unwrap();
        p.on_pending_commit(h);
        p.on_launch(H(SlotId(0), 1));
    }

    #[derive(Debug, Clone, Copy)]
    enum Op {
        Launch,
        Finalize,
        Commit,
    }

    proptest! {
        /// Random legal operation sequences keep: FIFO order, at most `depth` in flight,
        /// distinct slots for concurrent steps.
        #[test]
        fn invariants_hold(depth in 1usize..=2, ops in proptest::collection::vec(prop_oneof![Just(Op::Launch), Just(Op::Finalize), Just(Op::Commit)], 1..100)) {
            let mut p = P::new(depth);
            let mut next = 0u32;
            let mut expected_commit = 0u32;
            for op in ops {
                match op {
                    Op::Launch => if let Some(s) = p.free_slot() { p.on_launch(H(s, next)); next += 1; },
                    Op::Finalize => if let Some(h) = p.take_launch() { p.on_pending_commit(h); },
                    Op::Commit => if let Some(H(_, n)) = p.pop_oldest() {
                        prop_assert_eq!(n, expected_commit);
                        expected_commit += 1;
                        p.on_step_completed();
                    },
                }
                prop_assert!(p.in_flight() <= depth);
                prop_assert_eq!(p.slots_in_use.count_ones() as usize, p.in_flight());
            }
        }
    }
}
