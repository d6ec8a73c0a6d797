//! Sharing allocations with other processes: `export` hands out one file
//! descriptor per chunk and a layout record, `import` maps such
//! descriptors into a new allocation of this arena.
//!
//! **Export.** Only whole-chunk allocations of a caller can be exported
//! (a small allocation shares its slab's chunk with others). The arena's
//! driver must make exportable chunks (`ArenaConfig::exportable`): the
//! host gives each a sealed memfd of its own, CUDA creates them with the
//! POSIX file-descriptor handle type. An exported allocation is *pinned*
//! while any [`Export`] of it is open (dropped: closed), and *ever
//! exported* until it is freed:
//! - its chunks never return to the pool, where they would back another
//!   allocation that the importer could then read: `free` unmaps and
//!   releases them (the importer's mapping keeps the memory alive), and a
//!   shrink below the chunks it exported is refused;
//! - it never sleeps (a wake would give it new chunks the importer does
//!   not see);
//! - its chunks are never shared with another allocation of the arena
//!   (`alloc_shared` from it is refused, and an allocation that already
//!   shares chunks cannot be exported): the free would release chunks the
//!   other allocation still maps.
//!
//! **Import.** The chunks are mapped into a reservation of their own,
//! outside the arena's range: an import never moves, never takes part in
//! compaction, and counts apart (`imported_allocations`, `imported_bytes`),
//! not in the capacity, which is this arena's own memory. Its id works with
//! `query`, `read`, `write` (refused when read-only), `pin`/`unpin` (no
//! effect: it never moves) and `free`, which unmaps it, releases the
//! handles (closing the descriptors kept) and frees the reservation.
//! `resize`, `set_tag` and `export` of an import are `InvalidArgument`.
//!
//! Import ids are ids of this arena with generation 0, which no slot of
//! the arena ever issues (slot generations start at 1), so every other
//! operation already answers them `UnknownAllocation`.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use crate::driver::ChunkHandle;
use crate::error::{Error, Result};
use crate::id::IdParts;
use crate::sync::Ordering;
use crate::Id;

use super::alloc::Target;
use super::moves::release_retired_into;
use super::state::{self, Owner, State};
use super::{reserve_chunk_aligned, AllocInfo, Arena, Ctx, Inner, Touch};

/// The version of [`ExportLayout`] this library writes. It imports records
/// of this version and of version 1 (which had no handle type or device);
/// any other is refused.
pub const EXPORT_FORMAT_VERSION: u32 = 2;

/// [`ExportLayout::handle_type`]: not said (a version 1 record); the
/// importer assumes its own backend's.
pub const EXPORT_HANDLE_UNSPECIFIED: u32 = 0;
/// [`ExportLayout::handle_type`]: host backend chunks, sealed memfds.
pub const EXPORT_HANDLE_HOST_MEMFD: u32 = 1;
/// [`ExportLayout::handle_type`]: CUDA chunks,
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
pub const EXPORT_HANDLE_CUDA_POSIX_FD: u32 = 2;

/// The handle type a backend's chunks export as (by driver name).
pub(crate) fn handle_type_of(driver: &str) -> u32 {
    match driver {
        "host" => EXPORT_HANDLE_HOST_MEMFD,
        "cuda" => EXPORT_HANDLE_CUDA_POSIX_FD,
        _ => EXPORT_HANDLE_UNSPECIFIED,
    }
}

/// What an importer needs besides the descriptors, small enough to send in
/// one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportLayout {
    /// [`EXPORT_FORMAT_VERSION`] (or 1, from an older library).
    pub version: u32,
    /// Bytes per chunk: the importing arena's chunk size must be the same.
    pub chunk_bytes: u64,
    /// Chunks, one descriptor each, in address order.
    pub chunk_count: u64,
    /// The allocation's size in bytes when it was exported.
    pub size: u64,
    /// What the descriptors are (`EXPORT_HANDLE_*`): an arena of another
    /// backend refuses them. [`EXPORT_HANDLE_UNSPECIFIED`] in version 1.
    pub handle_type: u32,
    /// The exporter's CUDA device ordinal, -1 on the host (and in version
    /// 1). Informational: CUDA maps an imported chunk on the importing
    /// arena's device, which needs peer access when the two differ.
    pub device: i32,
}

impl ExportLayout {
    /// Checks the record against `fds` descriptors, a chunk size and the
    /// importer's handle type.
    pub fn check(&self, fds: usize, chunk_bytes: u64, handle_type: u32) -> Result<()> {
        if self.version != EXPORT_FORMAT_VERSION && self.version != 1 {
            return Err(Error::invalid(format!(
                "export layout version {} is neither {EXPORT_FORMAT_VERSION} nor 1",
                self.version
            )));
        }
        if self.handle_type != EXPORT_HANDLE_UNSPECIFIED && self.handle_type != handle_type {
            return Err(Error::invalid(format!(
                "exported handles of type {} cannot map into an arena whose chunks are of type {handle_type}",
                self.handle_type
            )));
        }
        if self.chunk_bytes != chunk_bytes {
            return Err(Error::invalid(format!(
                "exported chunks of {} bytes cannot map into an arena of {chunk_bytes}-byte chunks",
                self.chunk_bytes
            )));
        }
        if self.chunk_count == 0 || self.chunk_count != fds as u64 {
            return Err(Error::invalid(format!(
                "export layout says {} chunks, {fds} descriptors were given",
                self.chunk_count
            )));
        }
        let span =
            self.chunk_count.checked_mul(chunk_bytes).ok_or_else(|| Error::invalid("export layout overflows"))?;
        if self.size == 0 || self.size > span || self.size <= span - chunk_bytes {
            return Err(Error::invalid(format!(
                "export layout size {} does not fill {} chunks of {chunk_bytes} bytes",
                self.size, self.chunk_count
            )));
        }
        Ok(())
    }
}

/// An open export of one allocation ([`Arena::export`]): one descriptor per
/// chunk and the layout. The allocation stays pinned until every export of
/// it is dropped. The descriptors are this value's: dropping it closes
/// them (send them first; `SCM_RIGHTS` gives the receiver its own).
#[derive(Debug)]
pub struct Export {
    layout: ExportLayout,
    fds: Vec<OwnedFd>,
    _pin: Arc<()>,
}

impl Export {
    /// The layout record to send with the descriptors.
    pub fn layout(&self) -> ExportLayout {
        self.layout
    }

    /// The descriptors, one per chunk in address order (owned by the export).
    pub fn fds(&self) -> &[OwnedFd] {
        &self.fds
    }

    /// The descriptors, borrowed, as [`Arena::import`] takes them.
    pub fn borrowed_fds(&self) -> Vec<BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.fds.iter().map(|f| f.as_fd()).collect()
    }

    /// Duplicates of the descriptors (close-on-exec), owned by the caller:
    /// closing them does not affect the export. All or nothing (`OutOfMemory`
    /// when the process is out of descriptors).
    pub fn dup_fds(&self) -> Result<Vec<OwnedFd>> {
        self.fds
            .iter()
            .map(|f| {
                f.try_clone().map_err(|e| match e.raw_os_error() {
                    Some(libc::EMFILE | libc::ENFILE) => {
                        Error::OutOfMemory(format!("dup of an export descriptor: {e}"))
                    }
                    _ => Error::invalid(format!("dup of an export descriptor: {e}")),
                })
            })
            .collect()
    }

    /// Sends the layout and the descriptors over a Unix socket, in batches
    /// ([`crate::fd_passing::send_export`]); the receiver calls
    /// [`Arena::import_from_socket`].
    pub fn send(&self, sock: BorrowedFd<'_>) -> Result<()> {
        crate::fd_passing::send_export(sock, &self.layout, &self.borrowed_fds())
    }
}

/// An allocation that was exported.
#[derive(Debug)]
struct Exported {
    /// Held once here and once by each open [`Export`].
    pin: Arc<()>,
    /// The allocation is pinned because exports are open.
    by_export: bool,
    /// The caller's own pin, applied when the last export closes.
    user_pinned: bool,
    /// Most chunks exported: a shrink below this is refused.
    pages: u64,
    /// Held once here and once by each open DMA-BUF (`arena/dmabuf.rs`):
    /// while any is open, a free keeps the chunks (`Owner::DmaBuf`).
    dmabufs: Arc<()>,
}

/// An imported allocation.
#[derive(Debug)]
struct Import {
    /// The driver's reservation (base, size) and the chunk-aligned start in it.
    va: (u64, u64),
    base: u64,
    chunks: Vec<ChunkHandle>,
    size: u64,
    read_only: bool,
}

/// The arena's exports and imports (beside `State`, not in it: they are
/// not address-space bookkeeping, and survive every state copy as is).
#[derive(Debug, Default)]
pub(crate) struct Shares {
    exported: HashMap<u32, Exported>,
    imports: BTreeMap<u32, Import>,
    next_import: u32,
    /// Chunks of freed exported or DMA-BUF'd allocations whose release
    /// failed (never pooled): released again by `trim`, or at drop.
    leftover: Vec<ChunkHandle>,
    /// Imported chunks whose release failed (not the arena's memory, in no
    /// `driver_*` stat): released at drop.
    leftover_imported: Vec<ChunkHandle>,
    /// Import reservations whose free failed: freed at drop.
    leftover_va: Vec<(u64, u64)>,
    /// Slots freed while DMA-BUFs of them were open (`Owner::DmaBuf`).
    pub(super) held: std::collections::BTreeSet<u32>,
    /// Holds of DMA-BUF descriptors handed out with no close call
    /// (`Arena::dmabuf_fd`): kept until the arena is dropped.
    pub(super) kept: Vec<(Arc<()>, Arc<()>)>,
}

fn bump(c: &crate::sync::AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Shares {
    /// Restores the pin of allocations whose exports are all closed.
    pub(super) fn sweep(&mut self, st: &mut State) {
        for (&slot, e) in self.exported.iter_mut() {
            if e.by_export && Arc::strong_count(&e.pin) == 1 {
                e.by_export = false;
                st.alloc_mut(slot).pinned = e.user_pinned;
            }
        }
    }

    /// The import `id` names, if it is an import id of this arena.
    pub(super) fn import_of(&self, st: &State, id: Id) -> Option<Result<u32>> {
        let IdParts { small, generation, tag, slot } = id.parts();
        if small || generation != 0 || tag != st.tag {
            return None;
        }
        Some(match self.imports.contains_key(&slot) {
            true => Ok(slot),
            false => Err(Error::UnknownAllocation(id.get())),
        })
    }

    pub(super) fn is_exported(&self, slot: u32) -> bool {
        self.exported.contains_key(&slot)
    }

    /// Whether a DMA-BUF of `slot` is open.
    pub(super) fn dmabuf_open(&self, slot: u32) -> bool {
        self.exported.get(&slot).is_some_and(|e| Arc::strong_count(&e.dmabufs) > 1)
    }

    /// `query` of an import.
    pub(super) fn query(&self, st: &State, id: Id) -> Option<Result<AllocInfo>> {
        let k = match self.import_of(st, id)? {
            Ok(k) => k,
            Err(e) => return Some(Err(e)),
        };
        let i = &self.imports[&k];
        let bytes = i.chunks.len() as u64 * st.chunk;
        Some(Ok(AllocInfo {
            ptr: i.base,
            size: i.size,
            reserved_bytes: bytes,
            mapped_bytes: bytes,
            pinned: true,
            growable: false,
            tag: 0,
            asleep: false,
        }))
    }

    /// Address and size of an import, for `read` and `write`.
    pub(super) fn span(&self, st: &State, id: Id) -> Option<Result<(u64, u64)>> {
        Some(self.import_of(st, id)?.map(|k| (self.imports[&k].base, self.imports[&k].size)))
    }

    /// What `resize`, `set_tag` and `export` say to an import, and `resize`
    /// to a shrink of an exported allocation below its exported chunks.
    pub(super) fn check_resize(&self, st: &State, id: Id, new_pages: u64) -> Result<()> {
        if let Some(r) = self.import_of(st, id) {
            r?;
            return Err(Error::invalid("an imported allocation cannot be resized"));
        }
        if let Ok(Target::Chunks(slot)) = st.resolve(id) {
            if let Some(e) = self.exported.get(&slot) {
                if new_pages < e.pages {
                    return Err(Error::invalid(format!(
                        "an exported allocation keeps the {} chunks it exported until it is freed \
                         (another process may map them); it cannot shrink to {new_pages}",
                        e.pages
                    )));
                }
            }
        }
        Ok(())
    }

    /// `alloc_shared` from an import (no slot of this arena) or from an
    /// exported allocation (its free releases its chunks, which a sharer
    /// would still map).
    pub(super) fn check_share_source(&self, st: &State, id: Id) -> Result<()> {
        if let Some(r) = self.import_of(st, id) {
            r?;
            return Err(Error::invalid("alloc_shared: an imported allocation's chunks cannot be shared"));
        }
        if let Ok(Target::Chunks(slot)) = st.resolve(id) {
            if self.exported.contains_key(&slot) {
                return Err(Error::invalid(
                    "alloc_shared: an exported allocation's chunks cannot be shared (its free releases them)",
                ));
            }
        }
        Ok(())
    }

    /// `set_tag` of an import.
    pub(super) fn check_tag(&self, st: &State, id: Id) -> Result<()> {
        match self.import_of(st, id) {
            Some(r) => {
                r?;
                Err(Error::invalid("an imported allocation cannot be tagged (it never sleeps)"))
            }
            None => Ok(()),
        }
    }

    /// `pin` and `unpin`: `Some` when handled here (an import, which never
    /// moves, or an exported allocation whose exports keep it pinned).
    pub(super) fn set_pinned(&mut self, st: &mut State, id: Id, pinned: bool) -> Option<Result<()>> {
        if let Some(r) = self.import_of(st, id) {
            return Some(r.map(drop));
        }
        let Ok(Target::Chunks(slot)) = st.resolve(id) else { return None };
        let e = self.exported.get_mut(&slot)?;
        if !e.by_export {
            return None;
        }
        e.user_pinned = pinned;
        Some(Ok(()))
    }

    /// Imported allocations and their bytes.
    pub(super) fn imported(&self, chunk: u64) -> (u64, u64) {
        let n = self.imports.len() as u64;
        (n, self.imports.values().map(|i| i.chunks.len() as u64 * chunk).sum())
    }

    /// Allocations exported and not yet freed.
    pub(super) fn exported_count(&self) -> u64 {
        self.exported.len() as u64
    }

    /// At the arena's drop (after its synchronize): unmaps and releases
    /// every import, releases the leftovers. Best effort, never panics.
    pub(super) fn drop_all(&mut self, drv: &dyn crate::driver::Driver, chunk: u64, mode: super::unmap::UnmapMode) {
        for (_, i) in std::mem::take(&mut self.imports) {
            super::unmap::unmap_pages(drv, None, mode, i.base, chunk, i.chunks.len() as u64);
            for h in i.chunks {
                let _ = drv.release(h);
            }
            let _ = drv.free_reservation(i.va.0, i.va.1);
        }
        for h in self.leftover.drain(..).chain(self.leftover_imported.drain(..)) {
            let _ = drv.release(h);
        }
        for (b, s) in self.leftover_va.drain(..) {
            let _ = drv.free_reservation(b, s);
        }
    }
}

/// Releases the chunks of freed exported or DMA-BUF'd allocations (never
/// pooled: a peer may still reach them): at the free, and again by `trim`
/// for those whose release failed before; returns how many went back. One
/// that fails stays listed, counted in `release_failures` each time.
pub(super) fn release_leftovers(inner: &mut Inner, ctx: &Ctx<'_>) -> u64 {
    let mut released = 0;
    for h in std::mem::take(&mut inner.shares.leftover) {
        match super::txn::release(ctx.drv, ctx.counts, h) {
            Ok(()) => released += 1,
            Err(_) => {
                inner.shares.leftover.push(h);
                inner.release_failures += 1;
            }
        }
    }
    released
}

/// `free` of an import or of an exported allocation; `None` for any other id.
pub(super) fn free_shared(inner: &mut Inner, ctx: &Ctx<'_>, id: Id) -> Option<Result<()>> {
    if let Some(r) = inner.shares.import_of(&inner.st, id) {
        return Some(r.and_then(|k| free_import(inner, ctx, k)));
    }
    let Ok(Target::Chunks(slot)) = inner.st.resolve(id) else { return None };
    if !inner.shares.is_exported(slot) {
        return None;
    }
    Some(free_exported(inner, ctx, slot))
}

/// `free` of an exported allocation for a two-phase commit, which must not
/// fail for a driver call: when giving its chunks back fails (nothing
/// changed then), it is held as a free with an open DMA-BUF is, and the
/// next call gives them back (`dmabuf::reap`, retried until it succeeds).
/// `None` for an allocation that is not exported.
pub(super) fn free_exported_or_hold(inner: &mut Inner, ctx: &Ctx<'_>, id: Id) -> Option<()> {
    let Ok(Target::Chunks(slot)) = inner.st.resolve(id) else { return None };
    if !inner.shares.is_exported(slot) {
        return None;
    }
    if free_exported(inner, ctx, slot).is_err() {
        super::dmabuf::hold(&mut inner.st, slot);
        inner.shares.held.insert(slot);
    }
    Some(())
}

/// Unmaps an import (synchronizing first), then releases its handles and
/// frees its reservation. A failure up to the unmap leaves it as it was;
/// after it, a failed release or free is counted in `release_failures`
/// and retried at drop, and the free succeeds.
fn free_import(inner: &mut Inner, ctx: &Ctx<'_>, k: u32) -> Result<()> {
    let chunk = inner.st.chunk;
    let i = &inner.shares.imports[&k];
    ctx.drv.synchronize()?;
    bump(&ctx.counts.syncs);
    // An import's unmap and releases are not the arena's own memory: they
    // count in no `driver_*` stat (imports count in the sharing stats).
    let uncounted = super::txn::Counters::default();
    super::unmap::unmap_run(ctx.drv, &uncounted, ctx.unmaps, i.base, chunk, &i.chunks)?;
    let i = inner.shares.imports.remove(&k).expect("listed import");
    for h in i.chunks {
        if ctx.drv.release(h).is_err() {
            inner.shares.leftover_imported.push(h);
            inner.release_failures += 1;
        }
    }
    if ctx.drv.free_reservation(i.va.0, i.va.1).is_err() {
        inner.shares.leftover_va.push(i.va);
        inner.release_failures += 1;
    }
    Ok(())
}

/// Frees an exported allocation without pooling its chunks: unmaps its
/// backing (and every retired range, which may alias its chunks) on a copy
/// of the state, then releases the chunks. A failed unmap leaves everything
/// as it was; a failed release keeps the chunk out of the pool (retried at
/// drop) and counts in `release_failures`.
pub(super) fn free_exported(inner: &mut Inner, ctx: &Ctx<'_>, slot: u32) -> Result<()> {
    if inner.shares.dmabuf_open(slot) {
        super::dmabuf::hold(&mut inner.st, slot);
        inner.shares.held.insert(slot);
        return Ok(());
    }
    let st = &mut inner.st;
    let a = st.alloc(slot).clone();
    let mut sim = st.clone();
    let mut tx = ctx.txn(st);
    let done = (|| {
        release_retired_into(&mut sim, &mut tx)?;
        let pages: Vec<u64> = (a.start..a.start + a.backed).collect();
        for run in state::runs(&pages) {
            let hs: Vec<_> = run.clone().map(|p| sim.mapped[p as usize].expect("backing page is mapped")).collect();
            tx.unmap(run.start, hs)?;
        }
        Ok::<_, Error>(())
    })();
    match done {
        Ok(()) => tx.commit(),
        Err(e) => {
            tx.rollback();
            return Err(e);
        }
    }
    let doomed: Vec<ChunkHandle> =
        (a.start..a.start + a.backed).map(|p| sim.mapped[p as usize].take().expect("backing page")).collect();
    sim.backed_pages -= a.backed;
    sim.alloc_mut(slot).backed = 0;
    sim.remove_alloc(slot);
    *st = sim;
    inner.shares.exported.remove(&slot);
    inner.shares.held.remove(&slot);
    inner.shares.leftover.extend(doomed);
    release_leftovers(inner, ctx);
    Ok(())
}

impl Arena {
    /// Exports an allocation of whole chunks: a descriptor per chunk, owned
    /// by the returned [`Export`], and its layout. The allocation is pinned
    /// until every export of it is dropped, and from now until it is freed
    /// its chunks never go back to the pool (see the module docs).
    ///
    /// It first waits for the device (`synchronize`): every write queued
    /// before the call is complete when the descriptors exist, so an
    /// importer sees it; writes after it are the processes' to order (an
    /// IPC event, as PyTorch sends with its handles). Retired ranges are
    /// released next (they may map its chunks a second time). Errors: `InvalidArgument` for a small allocation, an import,
    /// or an allocation whose chunks another allocation shares (awake, or
    /// asleep and mapping them again when it wakes), `Asleep`,
    /// `Unsupported` when the driver's chunks are not exportable
    /// (`ArenaConfig::exportable`), a driver error otherwise; on error
    /// nothing changed and no descriptor is left open.
    pub fn export(&self, id: Id) -> Result<Export> {
        let (fds, layout, pin, _) = self.hand_out(id, "exported", |ctx, sim, a| {
            let mut fds = Vec::with_capacity(a.backed as usize);
            for p in a.start..a.start + a.backed {
                fds.push(ctx.drv.export_chunk(sim.mapped[p as usize].expect("backing page is mapped"))?);
            }
            Ok(fds)
        })?;
        Ok(Export { layout, fds, _pin: pin })
    }

    /// What [`Arena::export`] and [`Arena::dmabuf`] share: checks that `id`
    /// is an awake caller's allocation of whole chunks that no other
    /// allocation shares, releases retired ranges, runs `make` (the driver
    /// calls), and on success marks the allocation exported (pinned, chunks
    /// never pooled, no shrink below them, no sleep). Returns what `make`
    /// made, the layout, and the allocation's pin and DMA-BUF holds. On
    /// error nothing changed.
    pub(super) fn hand_out<T>(
        &self,
        id: Id,
        what: &str,
        make: impl Fn(&Ctx<'_>, &State, &state::Alloc) -> Result<T>,
    ) -> Result<(T, ExportLayout, Arc<()>, Arc<()>)> {
        let chunk = self.chunk;
        let (handle_type, device) = (handle_type_of(self.sh.driver.name()), self.device);
        self.run(Touch::Nothing, |inner, ctx, _| {
            if let Some(r) = inner.shares.import_of(&inner.st, id) {
                r?;
                return Err(Error::invalid(format!(
                    "an imported allocation cannot be {what} here (the exporting process can)"
                )));
            }
            let st = &mut inner.st;
            let slot = match st.resolve(id)? {
                Target::Chunks(s) if st.alloc(s).owner == Owner::User => s,
                _ => {
                    return Err(Error::invalid(format!(
                    "small allocations share their slab's chunk and cannot be {what}; allocate more than half a chunk"
                )))
                }
            };
            let a = st.alloc(slot).clone();
            if a.sleep.is_some() {
                return Err(Error::Asleep(id.get()));
            }
            if a.backed == 0 {
                return Err(Error::invalid(format!("an allocation of 0 bytes has no chunk to be {what}")));
            }
            // A chunk another allocation maps too (alloc_shared), or will map
            // again when it wakes (a sleeper's sharing group), would outlive
            // this one's free in that allocation, and then return to the
            // pool while an importer or a device still reaches it.
            let shared = (a.start..a.start + a.backed).any(|p| {
                st.mapped[p as usize].is_some_and(|h| st.shared.contains_key(&h) || st.groups.of_chunk.contains_key(&h))
            });
            if shared {
                return Err(Error::invalid(format!(
                    "an allocation that shares chunks with another (alloc_shared, awake or asleep) cannot be {what}"
                )));
            }
            let mut sim = st.clone();
            let mut tx = ctx.txn(st);
            let done = (|| {
                // The ordering rule: the device finishes every write queued
                // before the hand-out, so an importer (or a device reaching
                // the DMA-BUF) sees them; later writes are the processes'
                // to order (see DESIGN.md, "Export").
                tx.sync()?;
                release_retired_into(&mut sim, &mut tx)?;
                make(ctx, &sim, &a)
            })();
            let made = match done {
                Ok(v) => {
                    tx.commit();
                    *st = sim;
                    v
                }
                Err(e) => {
                    tx.rollback();
                    return Err(e);
                }
            };
            let e = inner.shares.exported.entry(slot).or_insert_with(|| Exported {
                pin: Arc::new(()),
                by_export: false,
                user_pinned: false,
                pages: 0,
                dmabufs: Arc::new(()),
            });
            if !e.by_export {
                e.user_pinned = st.alloc(slot).pinned;
                e.by_export = true;
            }
            e.pages = e.pages.max(a.backed);
            st.alloc_mut(slot).pinned = true;
            let layout = ExportLayout {
                version: EXPORT_FORMAT_VERSION,
                chunk_bytes: chunk,
                chunk_count: a.backed,
                size: a.size,
                handle_type,
                device,
            };
            Ok((made, layout, Arc::clone(&e.pin), Arc::clone(&e.dmabufs)))
        })
    }

    /// Maps the chunks behind `fds` (an export's descriptors, from this or
    /// another process, in order) into a new allocation of `layout.size`
    /// bytes in a reservation of its own; returns its id and address. The
    /// descriptors are borrowed: the arena keeps duplicates, closed at
    /// `free`. With `read_only`, the mapping is readable only (the backend
    /// enforces it: `write` through the arena is refused, and on the host a
    /// store through the pointer faults).
    ///
    /// `InvalidArgument` for a layout record that does not match (another
    /// version, another chunk size than this arena's, a count other than
    /// the descriptors', a size that does not fill the chunks) and for a
    /// descriptor that is closed or not an exported chunk of that size. All
    /// or nothing: on error nothing is mapped or kept.
    pub fn import(&self, layout: &ExportLayout, fds: &[BorrowedFd<'_>], read_only: bool) -> Result<(Id, u64)> {
        let chunk = self.chunk;
        layout.check(fds.len(), chunk, handle_type_of(self.sh.driver.name()))?;
        let total = layout.chunk_count * chunk;
        self.run(Touch::Nothing, |inner, ctx, _| {
            let k = inner.shares.next_import;
            if k == u32::MAX {
                return Err(Error::invalid("this arena has issued every import id"));
            }
            let (base, va) = reserve_chunk_aligned(ctx.drv, total, chunk)?;
            let mut handles = Vec::with_capacity(fds.len());
            let mut mapped = 0u64;
            let done = (|| {
                for fd in fds {
                    handles.push(ctx.drv.import_chunk(*fd, chunk, read_only)?);
                }
                // Imported chunks count in the sharing stats only, not in
                // any `driver_*` stat (they are not this arena's memory).
                for (i, &h) in handles.iter().enumerate() {
                    ctx.drv.map(base + i as u64 * chunk, chunk, h, 0)?;
                    mapped += 1;
                }
                ctx.drv.set_access(base, total)?;
                Ok::<_, Error>(())
            })();
            if let Err(e) = done {
                // Nothing touched the new mappings: no synchronize needed.
                super::unmap::unmap_pages(ctx.drv, None, ctx.unmaps, base, chunk, mapped);
                for h in handles {
                    let _ = ctx.drv.release(h);
                }
                let _ = ctx.drv.free_reservation(va.0, va.1);
                return Err(e);
            }
            inner.shares.next_import = k + 1;
            inner.shares.imports.insert(k, Import { va, base, chunks: handles, size: layout.size, read_only });
            let id = Id::compose(IdParts { small: false, generation: 0, tag: inner.st.tag, slot: k });
            Ok((id, base))
        })
    }

    /// Receives an export from a Unix socket ([`Export::send`] on the other
    /// side) and imports it; the received descriptors are closed once the
    /// import holds its own. Errors of [`crate::fd_passing::recv_export`]
    /// and of [`Arena::import`].
    pub fn import_from_socket(&self, sock: BorrowedFd<'_>, read_only: bool) -> Result<(Id, u64)> {
        use std::os::fd::AsFd;
        let (layout, fds) = crate::fd_passing::recv_export(sock)?;
        let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
        self.import(&layout, &borrowed, read_only)
    }

    /// [`Arena::import`] of an [`Export`] of this process.
    pub fn import_export(&self, export: &Export, read_only: bool) -> Result<(Id, u64)> {
        self.import(&export.layout(), &export.borrowed_fds(), read_only)
    }

    /// Whether an imported allocation is read-only (`None` for any other id).
    pub fn import_is_read_only(&self, id: Id) -> Result<Option<bool>> {
        let inner = self.lock()?;
        Ok(match inner.shares.import_of(&inner.st, id) {
            Some(k) => Some(inner.shares.imports[&k?].read_only),
            None => None,
        })
    }
}
