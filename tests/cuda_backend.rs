//! Driver-level checks of the CUDA backend on a real GPU.
//!
//! Every test opens device 0 with `CudaDriver::new(0)`; where that fails (no
//! libcuda, no device, no virtual memory management: CI and most developer
//! machines) the test prints why it is skipped and passes, unless
//! `VMM_ARENA_REQUIRE_GPU=1` is set (the GPU check sets it), which turns the
//! skip into a failure. On a GPU machine (see `scripts/README-gpu-check.md`)
//! they exercise the real driver.

use std::sync::Arc;

use vmm_arena::driver::cuda::CudaDriver;
use vmm_arena::driver::{ChunkHandle, Driver};
use vmm_arena::error::Error;
use vmm_arena::{Arena, ArenaConfig, Backend, ALL_TAGS, SLEEP_BACKUP};

/// Device 0, or `None` (with a message) where CUDA cannot run.
fn gpu(test: &str) -> Option<CudaDriver> {
    match CudaDriver::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            assert!(matches!(e, Error::Unsupported(_)), "{test}: unexpected error {e:?}");
            if std::env::var_os("VMM_ARENA_REQUIRE_GPU").is_some_and(|v| v == "1") {
                panic!("{test}: VMM_ARENA_REQUIRE_GPU=1 but CUDA is unusable: {e}");
            }
            eprintln!("{test}: skipped, no usable CUDA device: {e}");
            None
        }
    }
}

/// The chunk size the arena uses: the recommended granularity, at least 2 MiB.
fn chunk_size(d: &CudaDriver) -> u64 {
    let g = d.granularity().unwrap();
    let mut c = g.recommended.max(g.minimum);
    while c < 2 << 20 {
        c += g.recommended;
    }
    c
}

/// A deterministic byte pattern distinct per `seed`.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// A reservation of `n` chunks with `chunks` mapped contiguously and made
/// accessible with one `set_access`; undone by `teardown`.
struct Span {
    base: u64,
    chunk: u64,
    reserved: u64,
}

impl Span {
    fn reserve(d: &CudaDriver, chunk: u64, n: u64) -> Span {
        let reserved = chunk * n;
        let base = d.reserve(reserved, chunk).unwrap();
        assert_ne!(base, 0);
        assert_eq!(base % chunk, 0, "reservation is not aligned");
        Span { base, chunk, reserved }
    }

    fn map_all(&self, d: &CudaDriver, chunks: &[ChunkHandle]) {
        for (i, &h) in chunks.iter().enumerate() {
            d.map(self.base + i as u64 * self.chunk, self.chunk, h, 0).unwrap();
        }
        d.set_access(self.base, self.chunk * chunks.len() as u64).unwrap();
    }

    /// One `unmap` per mapping: `cuMemUnmap`'s text asks for "the entire
    /// contiguous address range that was mapped to", and a strict driver
    /// refuses a span of separate mappings.
    fn unmap_all(&self, d: &CudaDriver, n: usize) {
        for i in 0..n as u64 {
            d.unmap(self.base + i * self.chunk, self.chunk).unwrap();
        }
    }

    fn free(self, d: &CudaDriver) {
        d.free_reservation(self.base, self.reserved).unwrap();
    }
}

#[test]
fn granularity_and_capacity_are_sane() {
    let Some(d) = gpu("granularity_and_capacity_are_sane") else { return };
    let g = d.granularity().unwrap();
    assert!(g.minimum.is_power_of_two(), "{g:?}");
    assert_eq!(g.recommended % g.minimum, 0, "{g:?}");
    assert!(d.total_memory().unwrap() >= chunk_size(&d));
    assert_eq!(d.name(), "cuda");
    eprintln!(
        "device {} ({}), driver {}, granularity {g:?}, total {} MiB",
        d.device_ordinal(),
        d.device_name(),
        d.driver_version(),
        d.total_memory().unwrap() >> 20
    );
}

#[test]
fn write_read_round_trip_and_fill() {
    let Some(d) = gpu("write_read_round_trip_and_fill") else { return };
    let c = chunk_size(&d);
    let h = d.create(c).unwrap();
    let span = Span::reserve(&d, c, 1);
    span.map_all(&d, &[h]);

    let data = pattern(c as usize, 7);
    d.write(span.base, &data).unwrap();
    let mut back = vec![0u8; c as usize];
    d.read(span.base, &mut back).unwrap();
    assert!(back == data, "bytes differ after write/read");

    d.fill_u32(span.base + 4096, 0xdead_beef, 1024).unwrap();
    let mut words = vec![0u8; 4096 + 8];
    d.read(span.base + 4092, &mut words[..]).unwrap();
    assert_eq!(&words[..4], &data[4092..4096], "byte before the fill changed");
    for w in words[4..4100].chunks_exact(4) {
        assert_eq!(u32::from_ne_bytes(w.try_into().unwrap()), 0xdead_beef);
    }
    assert_eq!(&words[4100..], &data[8192..8196], "byte after the fill changed");

    d.synchronize().unwrap();
    span.unmap_all(&d, 1);
    d.release(h).unwrap();
    span.free(&d);
}

#[test]
fn one_chunk_mapped_at_two_addresses_shows_the_same_bytes() {
    let Some(d) = gpu("one_chunk_mapped_at_two_addresses_shows_the_same_bytes") else { return };
    let c = chunk_size(&d);
    let h = d.create(c).unwrap();
    let a = Span::reserve(&d, c, 1);
    let b = Span::reserve(&d, c, 1);
    a.map_all(&d, &[h]);
    b.map_all(&d, &[h]);

    let data = pattern(c as usize, 42);
    d.write(a.base, &data).unwrap();
    let mut back = vec![0u8; c as usize];
    d.read(b.base, &mut back).unwrap();
    assert!(back == data, "the second mapping does not show the first one's bytes");

    d.fill_u32(b.base, 0x0102_0304, 16).unwrap();
    let mut head = [0u8; 64];
    d.read(a.base, &mut head).unwrap();
    assert!(head.chunks_exact(4).all(|w| w == 0x0102_0304u32.to_ne_bytes()));

    // Release while mapped (trap 4): the memory lives until its last mapping goes.
    d.release(h).unwrap();
    d.read(b.base, &mut head).unwrap();
    assert!(head.chunks_exact(4).all(|w| w == 0x0102_0304u32.to_ne_bytes()));
    a.unmap_all(&d, 1);
    d.read(b.base, &mut back).unwrap();
    assert_eq!(&back[64..], &data[64..]);
    d.synchronize().unwrap();
    b.unmap_all(&d, 1);
    a.free(&d);
    b.free(&d);
}

#[test]
fn move_by_remap_keeps_every_byte() {
    let Some(d) = gpu("move_by_remap_keeps_every_byte") else { return };
    let c = chunk_size(&d);
    let n = 4usize;
    let chunks: Vec<_> = (0..n).map(|_| d.create(c).unwrap()).collect();
    let old = Span::reserve(&d, c, n as u64);
    // Map chunk by chunk, then one set_access over the whole span (trap 2).
    old.map_all(&d, &chunks);
    let data = pattern(c as usize * n, 3);
    d.write(old.base, &data).unwrap();

    // The arena's move: map the same chunks at a new range, one access call.
    let new = Span::reserve(&d, c, n as u64 + 2);
    new.map_all(&d, &chunks);
    let mut back = vec![0u8; data.len()];
    d.read(new.base, &mut back).unwrap();
    assert!(back == data, "bytes differ at the new address");

    // Retire the old range: synchronize, then unmap exactly what was mapped.
    d.synchronize().unwrap();
    old.unmap_all(&d, n);
    d.read(new.base, &mut back).unwrap();
    assert!(back == data, "bytes differ after the old range was unmapped");

    new.unmap_all(&d, n);
    for h in chunks {
        d.release(h).unwrap();
    }
    old.free(&d);
    new.free(&d);
}

#[test]
fn device_to_device_copy() {
    let Some(d) = gpu("device_to_device_copy") else { return };
    let c = chunk_size(&d);
    let (h1, h2) = (d.create(c).unwrap(), d.create(c).unwrap());
    let span = Span::reserve(&d, c, 2);
    span.map_all(&d, &[h1, h2]);
    let data = pattern(c as usize, 11);
    d.write(span.base, &data).unwrap();
    d.copy(span.base + c, span.base, c).unwrap();
    let mut back = vec![0u8; c as usize];
    d.read(span.base + c, &mut back).unwrap();
    assert!(back == data, "copy did not reproduce the bytes");
    d.synchronize().unwrap();
    span.unmap_all(&d, 2);
    d.release(h1).unwrap();
    d.release(h2).unwrap();
    span.free(&d);
}

#[test]
fn releasing_twice_is_an_error_not_a_driver_call() {
    let Some(d) = gpu("releasing_twice_is_an_error_not_a_driver_call") else { return };
    let h = d.create(chunk_size(&d)).unwrap();
    d.release(h).unwrap();
    assert!(matches!(d.release(h), Err(Error::InvalidArgument(_))));
    let span = Span::reserve(&d, chunk_size(&d), 1);
    assert!(matches!(d.map(span.base, chunk_size(&d), h, 0), Err(Error::InvalidArgument(_))));
    span.free(&d);
}

#[test]
fn driver_errors_carry_call_name_and_text() {
    let Some(d) = gpu("driver_errors_carry_call_name_and_text") else { return };
    let c = chunk_size(&d);
    let h = d.create(c).unwrap();
    // Address 0 lies in no reservation.
    match d.map(0, c, h, 0) {
        Err(Error::Driver { call, code, name, message }) => {
            assert_eq!(call, "cuMemMap");
            assert_ne!(code, 0);
            assert!(name.starts_with("CUDA_ERROR_"), "{name}");
            assert!(!message.is_empty());
        }
        other => panic!("expected a driver error, got {other:?}"),
    }
    d.release(h).unwrap();
}

#[test]
fn creating_more_than_the_device_holds_is_out_of_memory() {
    let Some(d) = gpu("creating_more_than_the_device_holds_is_out_of_memory") else { return };
    let g = d.granularity().unwrap();
    let too_much = (d.total_memory().unwrap() * 2).div_ceil(g.minimum) * g.minimum;
    match d.create(too_much) {
        Err(Error::OutOfMemory(msg)) => assert!(msg.contains("cuMemCreate"), "{msg}"),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
}

/// The calling thread's current context, straight from the driver.
fn current_context() -> usize {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: libcuda is loaded (the caller opened a `CudaDriver`); the
    // out-pointer is a valid local.
    let r = unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut ctx) };
    assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    ctx as usize
}

/// A thread that had no context has none after calling in: the backend
/// restores what was current. Left current, the primary context outlives
/// the last arena on that thread, and once the driver resets it (its last
/// reference released) the thread's own next driver call fails with
/// CUDA_ERROR_CONTEXT_IS_DESTROYED.
#[test]
fn a_thread_without_a_context_has_none_after_calling_in() {
    let Some(d) = gpu("a_thread_without_a_context_has_none_after_calling_in") else { return };
    let d = Arc::new(d);
    std::thread::spawn(move || {
        assert_eq!(current_context(), 0, "a fresh thread has no context");
        let c = chunk_size(&d);
        let h = d.create(c).unwrap();
        assert_eq!(current_context(), 0, "after cuMemCreate");
        d.release(h).unwrap();
        let cfg = ArenaConfig { capacity_bytes: 4 * c, chunk_bytes: c, ..Default::default() };
        let a = Arena::with_driver(Arc::clone(&d), cfg).unwrap();
        let (x, _) = a.alloc(2 * c).unwrap();
        a.free(x).unwrap();
        drop(a);
        assert_eq!(current_context(), 0, "after an arena's life");
    })
    .join()
    .unwrap();
}

#[test]
fn any_thread_may_call_in() {
    let Some(d) = gpu("any_thread_may_call_in") else { return };
    let d = Arc::new(d);
    let c = chunk_size(&d);
    let h = d.create(c).unwrap();
    let span = Span::reserve(&d, c, 1);
    span.map_all(&d, &[h]);
    let base = span.base;
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let d = Arc::clone(&d);
            std::thread::spawn(move || {
                // A fresh thread has no current context: the driver makes its own.
                let off = u64::from(t) * 4096;
                let data = pattern(4096, t);
                d.write(base + off, &data).unwrap();
                let mut back = vec![0u8; 4096];
                d.read(base + off, &mut back).unwrap();
                assert_eq!(back, data);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    d.synchronize().unwrap();
    span.unmap_all(&d, 1);
    d.release(h).unwrap();
    span.free(&d);
}

#[test]
fn a_second_driver_on_the_same_device_shares_the_primary_context() {
    let Some(d1) = gpu("a_second_driver_on_the_same_device_shares_the_primary_context") else {
        return;
    };
    let c = chunk_size(&d1);
    let h = d1.create(c).unwrap();
    let span = Span::reserve(&d1, c, 1);
    span.map_all(&d1, &[h]);
    d1.fill_u32(span.base, 77, 8).unwrap();
    {
        // Dropping another driver releases only its own retain.
        let d2 = CudaDriver::new(0).unwrap();
        let mut back = [0u8; 32];
        d2.read(span.base, &mut back).unwrap();
        assert!(back.chunks_exact(4).all(|w| w == 77u32.to_ne_bytes()));
    }
    let mut back = [0u8; 32];
    d1.read(span.base, &mut back).unwrap();
    assert!(back.chunks_exact(4).all(|w| w == 77u32.to_ne_bytes()));
    d1.synchronize().unwrap();
    span.unmap_all(&d1, 1);
    d1.release(h).unwrap();
    span.free(&d1);
}

#[test]
fn pinned_host_buffers_round_trip_and_outlive_the_driver() {
    let Some(d) = gpu("pinned_host_buffers_round_trip_and_outlive_the_driver") else {
        return;
    };
    let c = chunk_size(&d);
    let n = c as usize + 4097; // not a multiple of anything
    let mut buf = d.alloc_host(n).unwrap();
    assert!(buf.is_pinned(), "cuMemHostAlloc memory: {buf:?}");
    assert_eq!(buf.len(), n);
    assert!(buf.as_slice().iter().all(|&b| b == 0), "zeroed when made");
    let want = pattern(n, 41);
    let hs = [d.create(c).unwrap(), d.create(c).unwrap()];
    let span = Span::reserve(&d, c, 2);
    span.map_all(&d, &hs);
    // Device -> pinned host -> device, as sleep and wake copy a backup.
    d.write(span.base, &want).unwrap();
    d.read(span.base, buf.as_mut_slice()).unwrap();
    assert!(buf.as_slice() == want.as_slice(), "device to pinned host");
    d.fill_u32(span.base, 0, 2 * c / 4).unwrap();
    d.write(span.base, buf.as_slice()).unwrap();
    let mut back = vec![0u8; n];
    d.read(span.base, &mut back).unwrap();
    assert!(back == want, "pinned host to device");
    d.synchronize().unwrap();
    span.unmap_all(&d, 2);
    for h in hs {
        d.release(h).unwrap();
    }
    span.free(&d);
    assert!(!d.alloc_host(0).unwrap().is_pinned(), "an empty buffer needs no pinning");
    // The buffer holds the context: it stays valid, and frees cleanly, after
    // the driver is gone.
    drop(d);
    assert!(buf.as_slice() == want.as_slice());
    buf.as_mut_slice()[0] ^= 1;
    drop(buf);
    let d = CudaDriver::new(0).unwrap();
    let again = d.alloc_host(64).unwrap();
    assert!(again.is_pinned());
}

// --- The arena over the CUDA backend -----------------------------------------

#[test]
fn a_cuda_arena_is_unsupported_where_cuda_is() {
    // Runs everywhere: where CUDA is unusable (CI), creating a CUDA arena is
    // the unsupported error, never a panic.
    let cfg = ArenaConfig { backend: Backend::Cuda, capacity_bytes: 64 << 20, ..Default::default() };
    let made = std::panic::catch_unwind(|| Arena::new(cfg)).expect("Arena::new panicked");
    match (CudaDriver::new(0), made) {
        (Err(_), Err(e)) => assert!(matches!(e, Error::Unsupported(_)), "{e:?}"),
        (Err(_), Ok(_)) => panic!("a CUDA arena was made where CudaDriver::new fails"),
        (Ok(_), made) => {
            let a = made.expect("CudaDriver works but a CUDA arena cannot be made");
            assert_eq!(a.backend_name(), "cuda");
        }
    }
}

fn cuda_arena(test: &str, chunks: u64, reserve_chunks: u64) -> Option<(Arena, u64)> {
    let d = gpu(test)?;
    let c = chunk_size(&d);
    let cfg = ArenaConfig { capacity_bytes: chunks * c, reserve_bytes: reserve_chunks * c, ..Default::default() };
    let a = Arena::with_driver(d, cfg).unwrap();
    assert_eq!(a.chunk_bytes(), c);
    Some((a, c))
}

#[test]
fn arena_bytes_survive_growth_moves_and_compaction() {
    let Some((a, c)) = cuda_arena("arena_bytes_survive_growth_moves_and_compaction", 64, 16) else { return };
    let (x, _) = a.alloc(3 * c).unwrap();
    let (y, py) = a.alloc_growable(c, 4 * c).unwrap();
    let (z, _) = a.alloc(2 * c).unwrap();
    let ydata = pattern(4 * c as usize, 5);
    let zdata = pattern(2 * c as usize, 9);
    a.write(y, 0, &ydata[..c as usize]).unwrap();
    a.write(z, 0, &zdata).unwrap();

    // Growth within the reservation never moves.
    assert_eq!(a.resize(y, 4 * c).unwrap(), py);
    a.write(y, c, &ydata[c as usize..]).unwrap();
    a.free(x).unwrap();

    // Growth beyond it moves by remapping (or extends into free space).
    a.resize(y, 7 * c).unwrap();
    let mut back = vec![0u8; ydata.len()];
    a.read(y, 0, &mut back).unwrap();
    assert!(back == ydata, "y's bytes changed when it grew beyond its reservation");

    a.compact().unwrap();
    a.release_retired().unwrap();
    a.read(y, 0, &mut back).unwrap();
    assert!(back == ydata, "y's bytes changed by compaction");
    let mut zback = vec![0u8; zdata.len()];
    a.read(z, 0, &mut zback).unwrap();
    assert!(zback == zdata, "z's bytes changed");

    a.free(y).unwrap();
    a.free(z).unwrap();
    a.release_retired().unwrap();
    a.trim(0).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.live_allocations, s.mapped_bytes, s.pooled_bytes), (0, 0, 0), "{s:?}");
    assert_eq!(s.driver_creates, s.driver_releases, "{s:?}");
}

#[test]
fn arena_pooled_alloc_free_makes_no_driver_call() {
    let Some((a, c)) = cuda_arena("arena_pooled_alloc_free_makes_no_driver_call", 16, 64) else { return };
    let (id, _) = a.alloc(4 * c).unwrap();
    a.free(id).unwrap();
    let before = a.stats().unwrap();
    for _ in 0..100 {
        let (id, _) = a.alloc(4 * c).unwrap();
        a.free(id).unwrap();
    }
    let after = a.stats().unwrap();
    assert_eq!(
        (after.driver_creates, after.driver_maps, after.driver_access_calls, after.driver_unmaps, after.driver_syncs),
        (
            before.driver_creates,
            before.driver_maps,
            before.driver_access_calls,
            before.driver_unmaps,
            before.driver_syncs
        ),
        "the pooled path called the driver"
    );
}

#[test]
fn arena_sleep_with_backup_and_wake_restore_the_device_bytes() {
    let Some((a, c)) = cuda_arena("arena_sleep_with_backup_and_wake_restore_the_device_bytes", 16, 64) else {
        return;
    };
    let (w, wp) = a.alloc(3 * c + 100).unwrap();
    let (g, gp) = a.alloc_growable(c + 7, 4 * c).unwrap();
    let (k, _) = a.alloc(2 * c).unwrap();
    let (wdata, gdata, kdata) =
        (pattern(3 * c as usize + 100, 3), pattern(c as usize + 7, 4), pattern(2 * c as usize, 5));
    a.write(w, 0, &wdata).unwrap();
    a.write(g, 0, &gdata).unwrap();
    a.write(k, 0, &kdata).unwrap();
    a.set_tag(w, 1).unwrap();
    a.set_tag(g, 1).unwrap();
    a.sleep(1, SLEEP_BACKUP).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes), (2 * c, 0), "only k stays on the device: {s:?}");
    assert_eq!(s.backup_bytes, 3 * c + 100 + c + 7, "{s:?}");
    // The device memory is free for someone else meanwhile.
    let (t, _) = a.alloc(8 * c).unwrap();
    a.free(t).unwrap();
    a.wake(1).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.asleep_bytes, s.backup_bytes), (0, 0), "{s:?}");
    assert_eq!((a.query(w).unwrap().ptr, a.query(g).unwrap().ptr), (wp, gp), "same addresses");
    for (id, want) in [(w, &wdata), (g, &gdata), (k, &kdata)] {
        let mut back = vec![0u8; want.len()];
        a.read(id, 0, &mut back).unwrap();
        assert!(&back == want, "the bytes of {id} after wake");
    }
    // Without a backup the place stays and the bytes are the driver's.
    a.sleep(ALL_TAGS, 0).unwrap();
    assert_eq!(a.stats().unwrap().mapped_bytes, 0);
    a.wake(ALL_TAGS).unwrap();
    assert_eq!(a.query(w).unwrap().ptr, wp);
    for id in [w, g, k] {
        a.free(id).unwrap();
    }
    a.trim(0).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.driver_creates, s.driver_releases, "{s:?}");
}

#[test]
fn events_record_poll_wait_and_destroy() {
    let Some(d) = gpu("events_record_poll_wait_and_destroy") else { return };
    let e = d.record_event(0).unwrap().expect("CUDA records events");
    d.wait_event(e).unwrap();
    assert!(d.event_complete(e).unwrap(), "complete once waited for");
    d.destroy_event(e).unwrap();
}

#[test]
fn stream_ordered_frees_prefetch_and_resize_many_on_the_device() {
    let test = "stream_ordered_frees_prefetch_and_resize_many_on_the_device";
    let Some((a, c)) = cuda_arena(test, 8, 64) else { return };
    // A free on the default stream: pending until its event is seen complete.
    let (x, _) = a.alloc(2 * c).unwrap();
    a.free_on_stream(x, 0).unwrap();
    assert_eq!(a.stats().unwrap().stream_frees, 1);
    // The rest of the capacity, then more: the pending free's memory is
    // reclaimed (polled, or waited for) and serves, with no device synchronize.
    let (y, _) = a.alloc(6 * c).unwrap();
    let (z, _) = a.alloc(2 * c).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.pending_free_bytes, s.driver_syncs), (0, 0), "{s:?}");
    a.free(y).unwrap();
    a.free(z).unwrap();
    a.trim(0).unwrap();
    // Prefetch: growth into mapped-ahead chunks makes no driver call here.
    let (g, gp) = a.alloc_growable(c, 6 * c).unwrap();
    let (h, _) = a.alloc_growable(c, 6 * c).unwrap();
    let data = pattern(c as usize, 3);
    a.write(g, 0, &data).unwrap();
    a.set_prefetch(c, 2 * c).unwrap();
    a.maintain().unwrap();
    let calls = a.stats().unwrap().caller_driver_calls;
    assert_eq!(a.resize_many(&[(g, 3 * c), (h, 2 * c)]).unwrap()[0], gp);
    assert_eq!(a.stats().unwrap().caller_driver_calls, calls, "adopted the mapped-ahead chunks");
    let mut back = vec![0u8; data.len()];
    a.read(g, 0, &mut back).unwrap();
    assert!(back == data);
    a.free_on_stream(g, 0).unwrap();
    a.free(h).unwrap();
    drop(a); // destroys the pending event, releases everything
}

/// `Driver::import_chunk` refuses a descriptor of another size than the
/// one claimed, as the trait says, with `InvalidArgument`: a chunk twice
/// the claimed size (its second half would be silently missing) and one
/// half of it (`cuMemMap` would fail later with a driver error).
#[test]
fn imports_of_another_size_are_invalid_arguments() {
    let test = "imports_of_another_size_are_invalid_arguments";
    let Some(d) = gpu(test) else { return };
    let c = chunk_size(&d);
    let d = match CudaDriver::with_options(0, &[], true) {
        Ok(d) => d,
        Err(e) => return eprintln!("{test}: skipped, no exportable chunks here: {e}"),
    };
    let big = d.create(2 * c).unwrap();
    let small = d.create(c).unwrap();
    let big_fd = d.export_chunk(big).unwrap();
    let small_fd = d.export_chunk(small).unwrap();
    use std::os::fd::AsFd;
    for (fd, claimed, what) in [(&big_fd, c, "twice the claimed size"), (&small_fd, 2 * c, "half the claimed size")] {
        match d.import_chunk(fd.as_fd(), claimed, false) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("size"), "{what}: {m}"),
            Ok(h) => {
                d.release(h).unwrap();
                panic!("{what}: accepted");
            }
            Err(e) => panic!("{what}: {e:?}"),
        }
    }
    for (fd, size) in [(&big_fd, 2 * c), (&small_fd, c)] {
        let h = d.import_chunk(fd.as_fd(), size, false).unwrap();
        d.release(h).unwrap();
    }
    d.release(big).unwrap();
    d.release(small).unwrap();
}
