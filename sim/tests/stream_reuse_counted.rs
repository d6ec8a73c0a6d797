//! Same-stream reuse under the replay's counting driver (`Counted`, over
//! the sparse host backend), whose events complete only when the modelled
//! GPU finishes the step they were recorded in, and whose blocking waits
//! and synchronizes are counted as the time model charges them:
//!
//! - memory freed in a step on the engine's stream serves an allocation
//!   (and a batch growth) ordered on that stream in the same step with no
//!   blocking wait and no synchronize;
//! - the same request from another stream blocks (one blocking event wait).

use std::sync::Arc;

use vmm_arena::{Arena, ArenaConfig};
use vmm_sim::managers::{new_device, Dev};

const MIB: u64 = 1 << 20;
const C: u64 = 2 * MIB;
const ENGINE: u64 = 1;
const OTHER: u64 = 2;

/// An arena of `chunks` chunks on a counting device of the same capacity.
fn arena(chunks: u64) -> (Dev, Arena) {
    let dev = new_device(chunks * C).unwrap();
    let cfg = ArenaConfig { capacity_bytes: chunks * C, reserve_bytes: 64 * C, chunk_bytes: C, ..Default::default() };
    let a = Arena::with_driver(Arc::clone(&dev) as Arc<dyn vmm_arena::driver::Driver>, cfg).unwrap();
    (dev, a)
}

/// A step: a request of two chunks finishes and is freed on the engine's
/// stream (its event completes only when the step's GPU work is done).
fn step_with_a_free(a: &Arena) {
    let (x, _) = a.alloc_growable_on_stream(2 * C, 8 * C, ENGINE).unwrap();
    a.free_on_stream(x, ENGINE).unwrap();
}

#[test]
fn same_stream_admission_in_the_freeing_step_never_waits() {
    let (dev, a) = arena(4);
    let (keep, _) = a.alloc_on_stream(2 * C, ENGINE).unwrap();
    step_with_a_free(&a);
    let before = dev.calls();
    // The capacity is spent; what the step freed serves the admission.
    let (y, _) = a.alloc_growable_on_stream(2 * C, 8 * C, ENGINE).unwrap();
    let c = dev.calls().since(&before);
    assert_eq!((c.event_wait_blocked, c.synchronize, c.create), (0, 0, 0), "{c:?}");
    assert_eq!(a.stream_reused_chunks().unwrap(), 2);
    // Growth of the decode batch on the stream, in the step that frees
    // another request.
    a.free_on_stream(keep, ENGINE).unwrap();
    let before = dev.calls();
    a.resize_many_on_stream(&[(y, 4 * C)], ENGINE).unwrap();
    let c = dev.calls().since(&before);
    assert_eq!((c.event_wait_blocked, c.synchronize, c.create), (0, 0, 0), "{c:?}");
    assert_eq!(a.stream_reused_chunks().unwrap(), 4);
}

#[test]
fn cross_stream_admission_in_the_freeing_step_blocks() {
    let (dev, a) = arena(4);
    let (_keep, _) = a.alloc_on_stream(2 * C, ENGINE).unwrap();
    step_with_a_free(&a);
    let before = dev.calls();
    let (_y, _) = a.alloc_growable_on_stream(2 * C, 8 * C, OTHER).unwrap();
    let c = dev.calls().since(&before);
    assert_eq!(c.event_wait_blocked + c.synchronize, 1, "another stream waits for the event: {c:?}");
    assert_eq!(a.stream_reused_chunks().unwrap(), 0);
}
