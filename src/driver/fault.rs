//! A driver wrapper that fails chosen calls, counts every call, and tracks
//! what is alive on the driver's side, so tests can prove that every error
//! path rolls back and leaks nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::{CallKind, ChunkHandle, Driver, Granularity, HostBuffer, HostMemory};
use crate::error::{Error, Result};
use crate::sync::Mutex;

/// The error an injected failure produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// `Error::OutOfMemory`, as a driver out of memory returns.
    OutOfMemory,
    /// `Error::Driver`, any other driver failure.
    Driver,
}

impl FaultKind {
    /// Both kinds.
    pub const ALL: [FaultKind; 2] = [FaultKind::OutOfMemory, FaultKind::Driver];

    fn error(self, call: CallKind) -> Error {
        match self {
            FaultKind::OutOfMemory => Error::OutOfMemory(format!("injected failure of {call:?}")),
            FaultKind::Driver => Error::Driver {
                call: "injected",
                code: 999,
                name: "INJECTED".into(),
                message: format!("injected failure of {call:?}"),
            },
        }
    }
}

#[derive(Debug, Default)]
struct FaultState {
    /// Calls of each kind, at the kind's place in `CallKind::ALL` (an
    /// array: every driver call counts here, and tests make millions).
    calls: [u64; CallKind::ALL.len()],
    /// (kind filter, the call number that fails, error kind).
    plan: Option<(Option<CallKind>, u64, FaultKind)>,
    any_calls: u64,
    injected: u64,
    /// The kind of call the last injected failure hit.
    last_injected: Option<CallKind>,
    /// The last injected failure hit an event poll (`event_complete`) or
    /// an event's destroy (`destroy_event`): calls whose failure the arena
    /// absorbs (a poll reads as "not complete yet", a destroy leaks one
    /// event).
    last_injected_absorbable: bool,
    /// Events whose `destroy_event` failed by injection: the wrapped driver
    /// still has them, and this wrapper destroys them when dropped, so that
    /// an injected failure leaks nothing from the process.
    undestroyed_events: Vec<u64>,
    chunks: BTreeSet<ChunkHandle>,
    mappings: BTreeMap<u64, u64>,
}

/// Called with each call's kind as it enters the wrapper (before the
/// wrapped driver, with no lock of the wrapper held): a test's view of the
/// moments an operation spends in driver calls (see
/// [`FaultDriver::set_observer`]).
pub type Observer = Arc<dyn Fn(CallKind) + Send + Sync>;

#[derive(Default)]
struct ObserverSlot(std::sync::RwLock<Option<Observer>>);

impl std::fmt::Debug for ObserverSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ObserverSlot")
    }
}

/// Wraps a driver and fails the Nth call of a kind on request.
#[derive(Debug)]
pub struct FaultDriver<D: Driver> {
    inner: D,
    state: Mutex<FaultState>,
    observer: ObserverSlot,
    /// Host buffers lent through this wrapper and not yet dropped (shared
    /// with the buffers, which may outlive the wrapper).
    host_buffers: Arc<AtomicUsize>,
}

/// A host buffer of the wrapped driver that counts itself out when dropped.
#[derive(Debug)]
struct TrackedHostBuffer {
    buffer: HostBuffer,
    live: Arc<AtomicUsize>,
}

impl HostMemory for TrackedHostBuffer {
    fn bytes(&self) -> &[u8] {
        self.buffer.as_slice()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.buffer.as_mut_slice()
    }
    fn pinned(&self) -> bool {
        self.buffer.is_pinned()
    }
}

impl Drop for TrackedHostBuffer {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::Relaxed);
    }
}

impl<D: Driver> Drop for FaultDriver<D> {
    fn drop(&mut self) {
        // Best effort, never a panic: a failure here leaks one event.
        let events = std::mem::take(&mut self.st().undestroyed_events);
        for event in events {
            let _ = self.inner.destroy_event(event);
        }
    }
}

impl<D: Driver> FaultDriver<D> {
    /// Wraps `inner`; no failure is planned.
    pub fn new(inner: D) -> FaultDriver<D> {
        FaultDriver {
            inner,
            state: Mutex::new(FaultState::default()),
            observer: ObserverSlot::default(),
            host_buffers: Arc::default(),
        }
    }

    /// Sets (or, with `None`, removes) the observer called at every call's
    /// entry. A test reads the arena's stats from it while an operation is
    /// inside a driver call (as another thread could, where the operation
    /// made the call without the arena's lock).
    pub fn set_observer(&self, observer: Option<Observer>) {
        *self.observer.0.write().unwrap_or_else(|p| p.into_inner()) = observer;
    }

    /// The wrapped driver.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    fn st(&self) -> crate::sync::MutexGuard<'_, FaultState> {
        // A panic while holding this lock can only come from a test; keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fails the `n`th call (1-based, counted from now) of `kind`, or of any
    /// kind when `kind` is `None`, with `fault`. Replaces any earlier plan.
    pub fn fail_nth(&self, kind: Option<CallKind>, n: u64, fault: FaultKind) {
        let mut s = self.st();
        let base = match kind {
            Some(k) => s.calls[k as usize],
            None => s.any_calls,
        };
        s.plan = Some((kind, base + n.max(1), fault));
    }

    /// Whether the last injected failure hit an event poll or an event's
    /// destroy, whose failures the arena absorbs (a poll reads as "not
    /// complete yet"; a destroy leaks one event, which this wrapper
    /// destroys when dropped).
    pub fn last_injected_into_a_poll_or_destroy(&self) -> bool {
        self.st().last_injected_absorbable
    }

    /// Cancels a planned failure that has not fired.
    pub fn clear(&self) {
        self.st().plan = None;
    }

    /// Whether the planned failure is still pending.
    pub fn pending(&self) -> bool {
        self.st().plan.is_some()
    }

    /// Calls of `kind` so far.
    pub fn calls(&self, kind: CallKind) -> u64 {
        self.st().calls[kind as usize]
    }

    /// Calls of every kind so far.
    pub fn total_calls(&self) -> u64 {
        self.st().any_calls
    }

    /// Failures injected so far.
    pub fn injected(&self) -> u64 {
        self.st().injected
    }

    /// The kind of call the last injected failure hit (`None` before any):
    /// a test tells by it a failure the arena absorbs by design (a failed
    /// event poll reads as not complete yet) from one it must report.
    pub fn last_injected(&self) -> Option<CallKind> {
        self.st().last_injected
    }

    /// Chunks created through this wrapper and not released.
    pub fn live_chunks(&self) -> usize {
        self.st().chunks.len()
    }

    /// Mappings made through this wrapper and not unmapped.
    pub fn live_mappings(&self) -> usize {
        self.st().mappings.len()
    }

    /// Host buffers lent through this wrapper ([`Driver::alloc_host`]) and
    /// not yet dropped.
    pub fn live_host_buffers(&self) -> usize {
        self.host_buffers.load(Ordering::Relaxed)
    }

    /// Counts the call and returns the injected error if this one must fail.
    fn enter(&self, kind: CallKind) -> Result<()> {
        let observer = self.observer.0.read().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(observe) = observer {
            observe(kind);
        }
        let mut s = self.st();
        let n = {
            let c = &mut s.calls[kind as usize];
            *c += 1;
            *c
        };
        s.any_calls += 1;
        let any = s.any_calls;
        if let Some((filter, at, fault)) = s.plan {
            let hit = match filter {
                Some(k) => k == kind && n == at,
                None => any == at,
            };
            if hit {
                s.plan = None;
                s.injected += 1;
                s.last_injected = Some(kind);
                s.last_injected_absorbable = false;
                return Err(fault.error(kind));
            }
        }
        Ok(())
    }
}

impl<D: Driver> Driver for FaultDriver<D> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn granularity(&self) -> Result<Granularity> {
        self.inner.granularity()
    }
    fn total_memory(&self) -> Result<u64> {
        self.inner.total_memory()
    }
    fn reserve(&self, size: u64, align: u64) -> Result<u64> {
        self.enter(CallKind::Reserve)?;
        self.inner.reserve(size, align)
    }
    fn free_reservation(&self, base: u64, size: u64) -> Result<()> {
        self.enter(CallKind::FreeReservation)?;
        self.inner.free_reservation(base, size)
    }
    fn create(&self, size: u64) -> Result<ChunkHandle> {
        self.enter(CallKind::Create)?;
        let h = self.inner.create(size)?;
        self.st().chunks.insert(h);
        Ok(h)
    }
    fn release(&self, chunk: ChunkHandle) -> Result<()> {
        self.enter(CallKind::Release)?;
        self.inner.release(chunk)?;
        self.st().chunks.remove(&chunk);
        Ok(())
    }
    fn map(&self, addr: u64, size: u64, chunk: ChunkHandle, offset: u64) -> Result<()> {
        self.enter(CallKind::Map)?;
        self.inner.map(addr, size, chunk, offset)?;
        self.st().mappings.insert(addr, size);
        Ok(())
    }
    fn set_access(&self, addr: u64, size: u64) -> Result<()> {
        self.enter(CallKind::SetAccess)?;
        self.inner.set_access(addr, size)
    }
    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        self.enter(CallKind::Unmap)?;
        self.inner.unmap(addr, size)?;
        let mut s = self.st();
        let gone: Vec<u64> = s.mappings.range(addr..addr + size).map(|(&a, _)| a).collect();
        for a in gone {
            s.mappings.remove(&a);
        }
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        self.enter(CallKind::Synchronize)?;
        self.inner.synchronize()
    }
    fn read(&self, addr: u64, dst: &mut [u8]) -> Result<()> {
        self.enter(CallKind::Data)?;
        self.inner.read(addr, dst)
    }
    fn write(&self, addr: u64, src: &[u8]) -> Result<()> {
        self.enter(CallKind::Data)?;
        self.inner.write(addr, src)
    }
    fn copy(&self, dst: u64, src: u64, len: u64) -> Result<()> {
        self.enter(CallKind::Data)?;
        self.inner.copy(dst, src, len)
    }
    fn record_event(&self, stream: u64) -> Result<Option<u64>> {
        self.enter(CallKind::Event)?;
        self.inner.record_event(stream)
    }
    fn event_complete(&self, event: u64) -> Result<bool> {
        if let Err(e) = self.enter(CallKind::Event) {
            self.st().last_injected_absorbable = true;
            return Err(e);
        }
        self.inner.event_complete(event)
    }
    fn wait_event(&self, event: u64) -> Result<()> {
        self.enter(CallKind::Event)?;
        self.inner.wait_event(event)
    }
    fn destroy_event(&self, event: u64) -> Result<()> {
        if let Err(e) = self.enter(CallKind::Event) {
            let mut s = self.st();
            s.undestroyed_events.push(event);
            s.last_injected_absorbable = true;
            return Err(e);
        }
        self.inner.destroy_event(event)
    }
    fn alloc_host(&self, len: usize) -> Result<HostBuffer> {
        self.enter(CallKind::HostAlloc)?;
        let buffer = self.inner.alloc_host(len)?;
        self.host_buffers.fetch_add(1, Ordering::Relaxed);
        Ok(HostBuffer::new(Box::new(TrackedHostBuffer { buffer, live: Arc::clone(&self.host_buffers) })))
    }
    #[cfg(unix)]
    fn export_chunk(&self, chunk: ChunkHandle) -> Result<std::os::fd::OwnedFd> {
        self.enter(CallKind::Share)?;
        self.inner.export_chunk(chunk)
    }
    #[cfg(unix)]
    fn import_chunk(&self, fd: std::os::fd::BorrowedFd<'_>, size: u64, read_only: bool) -> Result<ChunkHandle> {
        self.enter(CallKind::Share)?;
        let h = self.inner.import_chunk(fd, size, read_only)?;
        self.st().chunks.insert(h);
        Ok(h)
    }
    #[cfg(unix)]
    fn dmabuf_fd(&self, addr: u64, size: u64) -> Result<std::os::fd::OwnedFd> {
        self.enter(CallKind::Share)?;
        self.inner.dmabuf_fd(addr, size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::mock::MockDriver;

    #[test]
    fn call_kinds_index_their_place_in_all() {
        // `FaultState::calls` is indexed by `kind as usize`.
        for (i, k) in CallKind::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i, "{k:?}");
        }
    }

    #[test]
    fn fails_exactly_the_nth_call_once() {
        let d = FaultDriver::new(MockDriver::new(4096, 1 << 30));
        d.fail_nth(Some(CallKind::Create), 2, FaultKind::OutOfMemory);
        let a = d.create(4096).unwrap();
        assert_eq!(d.last_injected(), None);
        assert!(matches!(d.create(4096), Err(Error::OutOfMemory(_))));
        let b = d.create(4096).unwrap();
        assert_eq!((d.calls(CallKind::Create), d.injected(), d.live_chunks()), (3, 1, 2));
        assert_eq!(d.last_injected(), Some(CallKind::Create));
        d.fail_nth(None, 1, FaultKind::Driver);
        assert!(matches!(d.release(a), Err(Error::Driver { .. })));
        assert_eq!(d.last_injected(), Some(CallKind::Release));
        d.release(a).unwrap();
        d.release(b).unwrap();
        assert_eq!(d.live_chunks(), 0);
    }

    #[test]
    fn host_buffers_can_fail_and_are_counted_until_dropped() {
        let d = FaultDriver::new(MockDriver::new(4096, 1 << 30));
        d.fail_nth(Some(CallKind::HostAlloc), 1, FaultKind::OutOfMemory);
        assert!(matches!(d.alloc_host(8), Err(Error::OutOfMemory(_))));
        assert_eq!(d.live_host_buffers(), 0);
        let mut b = d.alloc_host(8).unwrap();
        b.as_mut_slice()[7] = 1;
        let other = d.alloc_host(4).unwrap();
        assert_eq!((b.len(), b.as_slice()[7], d.live_host_buffers()), (8, 1, 2));
        drop(other);
        assert_eq!(d.live_host_buffers(), 1);
        drop(d); // the buffer outlives the driver
        assert_eq!(b.as_slice()[7], 1);
    }
}
