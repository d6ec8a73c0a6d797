//! Device groups: one arena per device of a tensor-parallel group, and
//! allocations made on every member at once, all or nothing.
//!
//! A model sharded over N devices needs the same shard on every device in
//! the same step; if one device cannot serve it, the step fails (the
//! bucket effect of the design brief). A [`Group`] makes that explicit:
//! [`Group::alloc`], [`Group::alloc_growable`], [`Group::resize`] and
//! [`Group::free`] act on every member, in member order, and a failure on
//! member `k` undoes what members `0..k` did before the error is returned.
//! The error ([`GroupError`]) names the member that failed.
//!
//! Group allocations are always of whole chunks (never in a small
//! allocation's slab), so that an undo restores what every member maps.
//!
//! **Undo.** The undo of an allocation is a free; the undo of a growth is a
//! shrink back to the old size. Both are pure bookkeeping in an arena (a
//! shrink caches its tail chunks, a free caches all of them, or retires a
//! page whose chunk another allocation still maps; neither makes a driver
//! call except the best-effort give-back of the retain watermark, whose
//! failure the arena absorbs and counts in `release_failures`). The one
//! shrink that does make a call, of a growable allocation's pages whose
//! chunks another allocation maps too (`alloc_shared`), cannot be an undo:
//! the pages a growth just backed hold pooled or new chunks, which no other
//! allocation maps. So an undo cannot fail for want of memory or a driver
//! error. It fails only if
//! the member itself refuses the call: it is poisoned by a panic, or the
//! caller changed the member's allocation behind the group's back (freed
//! it, or put it to sleep through [`Group::member`]). Then the error says
//! so in [`GroupError::undo_failures`] and that member keeps the partial
//! change (a live allocation, or the grown size), which the member's own
//! `free` and `resize` can still act on.
//!
//! What an undo does not restore: a growth that had to *move* the member's
//! allocation (or its neighbours) leaves it at its new address after the
//! shrink back, with its bytes, as any move does (the member's move
//! callback was told), and chunks created for it stay pooled in that
//! member. Sizes, contents, live and mapped bytes are as before. A
//! reservation the growth extended in place (into the free range after
//! it) is trimmed back after the shrink, so the member's free ranges are as
//! before. Retired ranges that the change released on an undone member (to
//! make room) cannot be mapped back, so they are released on every member
//! instead (`Arena::release_retired`, which synchronizes the device unless
//! the pages are known idle), the failing member and those after it
//! included: the members' free ranges stay alike, and with
//! `deterministic_placement` the next group allocation lands at one offset
//! on every member (`tests/group_undo_model.rs`:
//! `an_undone_growth_releases_retired_ranges_on_every_member`). That is
//! the one change an undone operation leaves on the member that failed.
//!
//! **Shrinks and frees** make no driver call that can fail, so a group
//! shrink cannot fail part-way except as above, or when a member's shard
//! shares chunks with an allocation made through [`Group::member`]
//! (`alloc_shared`; its shrink unmaps them and can fail): then the members
//! before it are grown back, which can itself fail for memory, and is
//! reported in `undo_failures`. A group free first checks
//! that every member still knows its allocation (so a stale or poisoned
//! member fails the free before anything is freed); a free cannot be
//! undone, so if a member fails after that check anyway, the others are
//! freed nonetheless and the error names the member.
//!
//! **Peer access** (CUDA, [`GroupConfig::peer_access`]): every member's
//! chunks are made accessible from every other device of the group, one
//! access descriptor per device in each `cuMemSetAccess` (design trap 6:
//! `cudaDeviceEnablePeerAccess` does not reach VMM mappings). On the host
//! backend N arenas stand for N devices and peer access changes nothing:
//! all of them live in one process's memory.
//!
//! Concurrency: a `Group` is `Send + Sync`. Calls on different group
//! allocations run concurrently (each member arena serializes its own
//! calls); calls on the same group allocation are serialized by a lock of
//! its own. Member move callbacks must not call into the group (such calls
//! fail with `InvalidArgument`, like an arena's own re-entrancy check).

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use crate::arena::{AllocInfo, Arena, ArenaConfig, Backend, Stats};
use crate::error::{Error, Result, Status};
use crate::Id;

/// Names one group allocation for the group's lifetime; never 0, never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupId(u64);

impl GroupId {
    /// The raw value (what the C ABI passes).
    pub fn get(self) -> u64 {
        self.0
    }

    /// The id for a raw value; `None` for 0, which is never issued.
    pub fn from_raw(raw: u64) -> Option<GroupId> {
        (raw != 0).then_some(GroupId(raw))
    }
}

/// A failed group operation: the error, the member whose call failed (none
/// for a bad argument or an unknown group id), and any undo that failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupError {
    /// Index of the member whose call failed.
    pub member: Option<usize>,
    /// That member's error (or the group's own).
    pub error: Error,
    /// Members whose undo failed, with their errors (see the module docs:
    /// only a poisoned member or one changed behind the group's back).
    /// Those members keep the partial change.
    pub undo_failures: Vec<(usize, Error)>,
}

impl GroupError {
    fn group(error: Error) -> GroupError {
        GroupError { member: None, error, undo_failures: Vec::new() }
    }

    fn member(member: usize, error: Error) -> GroupError {
        GroupError { member: Some(member), error, undo_failures: Vec::new() }
    }

    /// The C status: the failing member's.
    pub fn status(&self) -> Status {
        self.error.status()
    }
}

impl fmt::Display for GroupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(m) = self.member {
            write!(f, "group member {m}: ")?;
        }
        write!(f, "{}", self.error)?;
        for (m, e) in &self.undo_failures {
            write!(f, "; undo on member {m} failed, it keeps the partial change: {e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for GroupError {}

impl From<GroupError> for Error {
    /// The same variant, its message naming the member where the variant
    /// has one (an id-carrying variant keeps its id).
    fn from(g: GroupError) -> Error {
        let text = g.to_string();
        match g.error {
            Error::InvalidArgument(_) => Error::InvalidArgument(text),
            Error::OutOfMemory(_) => Error::OutOfMemory(text),
            Error::OutOfAddressSpace(_) => Error::OutOfAddressSpace(text),
            Error::Unsupported(_) => Error::Unsupported(text),
            Error::Internal(_) => Error::Internal(text),
            Error::Stale(_) => Error::Stale(text),
            Error::Driver { call, code, name, .. } => Error::Driver { call, code, name, message: text },
            e @ (Error::UnknownAllocation(_) | Error::Pinned(_) | Error::Asleep(_)) => e,
        }
    }
}

/// Result of a group operation.
pub type GroupResult<T> = std::result::Result<T, GroupError>;

/// How [`Group::new`] sets up its members.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupConfig {
    /// Every member's configuration; `device` is replaced by each member's
    /// entry of `devices`.
    pub arena: ArenaConfig,
    /// One member per entry: CUDA device ordinals (distinct), or on the host
    /// backends any distinct labels (N arenas stand for N devices).
    pub devices: Vec<i32>,
    /// CUDA: make every member's chunks accessible from every other device
    /// of the group (checked with `cuDeviceCanAccessPeer` first: a pair
    /// without peer access is `Unsupported`). Host: accepted, no effect.
    pub peer_access: bool,
}

struct Entry {
    ids: Vec<Id>,
    size: u64,
    freed: bool,
}

/// One arena per device, and allocations made on all of them at once
/// (see the [module docs](self)).
pub struct Group {
    /// Shared, so that a C caller can hold a member's arena
    /// (`vmm_arena_group_member`); it lives until the group and every such
    /// handle are gone.
    members: Vec<Arc<Arena>>,
    devices: Vec<i32>,
    entries: Mutex<HashMap<u64, Arc<Mutex<Entry>>>>,
    next_id: std::sync::atomic::AtomicU64,
    key: u64,
}

impl fmt::Debug for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group").field("devices", &self.devices).field("members", &self.members).finish_non_exhaustive()
    }
}

static NEXT_GROUP_KEY: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

thread_local! {
    /// Groups with an operation in progress on this thread (a member's
    /// move callback calling back into the group would deadlock).
    static IN_GROUP_OP: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Marks this thread as inside an operation of group `key` until dropped.
struct OpScope(u64);

impl OpScope {
    fn enter(key: u64) -> GroupResult<OpScope> {
        let busy = IN_GROUP_OP.with(|v| v.borrow().contains(&key));
        if busy {
            return Err(GroupError::group(Error::invalid(
                "the group was called from inside one of its own operations (a member's move callback)",
            )));
        }
        IN_GROUP_OP.with(|v| v.borrow_mut().push(key));
        Ok(OpScope(key))
    }
}

impl Drop for OpScope {
    fn drop(&mut self) {
        let _ = IN_GROUP_OP.try_with(|v| {
            if let Ok(mut v) = v.try_borrow_mut() {
                if let Some(i) = v.iter().rposition(|&k| k == self.0) {
                    v.remove(i);
                }
            }
        });
    }
}

fn poisoned() -> GroupError {
    GroupError::group(Error::Internal("the group's table is poisoned by an earlier panic".into()))
}

impl Group {
    /// Opens one arena per entry of `config.devices` on `config.arena`'s
    /// backend. With CUDA and `peer_access`, each member's driver gives
    /// access to every other device of the group.
    pub fn new(config: GroupConfig) -> GroupResult<Group> {
        let configs = config.devices.iter().map(|&device| ArenaConfig { device, ..config.arena }).collect();
        Group::with_member_configs(configs, config.peer_access)
    }

    /// Like [`Group::new`] with a configuration of its own for each member
    /// (its `device` names the member's device; capacities, chunk sizes and
    /// flags may differ, e.g. a device that also holds other work). The
    /// members should share a chunk size and a backend; nothing requires it.
    pub fn with_member_configs(configs: Vec<ArenaConfig>, peer_access: bool) -> GroupResult<Group> {
        let devices: Vec<i32> = configs.iter().map(|c| c.device).collect();
        check_devices(&devices)?;
        let mut members = Vec::with_capacity(configs.len());
        for (i, &cfg) in configs.iter().enumerate() {
            let device = cfg.device;
            let arena = match (cfg.backend, peer_access) {
                (Backend::Cuda, true) => {
                    let peers: Vec<i32> = devices.iter().copied().filter(|&d| d != device).collect();
                    // `exportable` is the arena config's, as without peers.
                    crate::driver::cuda::CudaDriver::with_options(device, &peers, cfg.exportable)
                        .and_then(|d| Arena::with_driver(d, cfg))
                }
                _ => Arena::new(cfg),
            };
            // Members made so far are dropped (and release everything) on error.
            members.push(arena.map_err(|e| GroupError::member(i, e))?);
        }
        Ok(Group::assemble(members, devices))
    }

    /// A group over arenas made elsewhere (any driver: a fault injector, a
    /// mock), member `i` standing for device `i`. They should share a chunk
    /// size; nothing requires it.
    pub fn from_arenas(members: Vec<Arena>) -> GroupResult<Group> {
        let devices: Vec<i32> = (0..members.len() as i32).collect();
        check_devices(&devices)?;
        Ok(Group::assemble(members, devices))
    }

    fn assemble(members: Vec<Arena>, devices: Vec<i32>) -> Group {
        Group {
            members: members.into_iter().map(Arc::new).collect(),
            devices,
            entries: Mutex::new(HashMap::new()),
            next_id: std::sync::atomic::AtomicU64::new(1),
            key: NEXT_GROUP_KEY.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Always false: a group has at least one member.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Member `i`'s arena (for its own allocations, reads, writes, stats).
    /// Changing a group allocation's member directly (free, resize, sleep)
    /// breaks the group's all-or-nothing guarantee for it.
    pub fn member(&self, i: usize) -> &Arena {
        &self.members[i]
    }

    /// Member `i`'s arena, shared: it outlives the group while held.
    pub fn member_shared(&self, i: usize) -> Arc<Arena> {
        Arc::clone(&self.members[i])
    }

    /// The device each member stands for.
    pub fn devices(&self) -> &[i32] {
        &self.devices
    }

    /// Allocates `size` bytes on every member; returns the group id and each
    /// member's address (member order). All or nothing.
    ///
    /// A group allocation is always of whole chunks, however small: a
    /// shard in a slab, grown past the small classes on some members and
    /// then undone, would stay in whole chunks there (the arena cannot put
    /// it back in a slab), and members would no longer map the same.
    pub fn alloc(&self, size: u64) -> GroupResult<(GroupId, Vec<u64>)> {
        self.alloc_with(size, |a| a.alloc_whole(size, size, false, crate::arena::Placing::Whole))
    }

    /// [`Arena::alloc_growable`] on every member. All or nothing.
    pub fn alloc_growable(&self, size: u64, max_size: u64) -> GroupResult<(GroupId, Vec<u64>)> {
        self.alloc_with(size, |a| a.alloc_growable(size, max_size))
    }

    fn alloc_with(&self, size: u64, f: impl Fn(&Arena) -> Result<(Id, u64)>) -> GroupResult<(GroupId, Vec<u64>)> {
        let _scope = OpScope::enter(self.key)?;
        let mut ids = Vec::with_capacity(self.members.len());
        let mut ptrs = Vec::with_capacity(self.members.len());
        let retired = self.retired_ranges();
        for (k, arena) in self.members.iter().enumerate() {
            match f(arena) {
                Ok((id, ptr)) => {
                    ids.push(id);
                    ptrs.push(ptr);
                }
                Err(e) => {
                    let mut err = GroupError::member(k, e);
                    for (j, &id) in ids.iter().enumerate() {
                        if let Err(u) = self.members[j].free(id) {
                            err.undo_failures.push((j, u));
                        }
                    }
                    self.release_retired_like_the_undone(&retired, k, &mut err);
                    return Err(err);
                }
            }
        }
        let raw = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let entry = Arc::new(Mutex::new(Entry { ids, size, freed: false }));
        match self.entries.lock() {
            Ok(mut t) => {
                t.insert(raw, entry);
            }
            Err(_) => {
                // Cannot record it: give it back rather than leak it.
                let e = entry.lock().map(|e| e.ids.clone()).unwrap_or_default();
                for (j, id) in e.into_iter().enumerate() {
                    let _ = self.members[j].free(id);
                }
                return Err(poisoned());
            }
        }
        Ok((GroupId(raw), ptrs))
    }

    /// Each member's retired ranges (empty for a member that cannot say:
    /// it is left alone by the undo).
    fn retired_ranges(&self) -> Vec<Vec<(u64, u64)>> {
        self.members.iter().map(|a| a.retired_ranges().unwrap_or_default()).collect()
    }

    /// After the undo of an operation that failed on member `failed`: where
    /// the change had released retired ranges (to make room) on a member it
    /// was undone on, which the undo cannot map back, releases the retired
    /// ranges of every member that still holds some of those it held
    /// before, so that the members' free ranges stay alike and
    /// deterministic placement keeps giving every member one offset. A
    /// release that fails is reported in `undo_failures` (that member keeps
    /// its retired ranges).
    fn release_retired_like_the_undone(&self, before: &[Vec<(u64, u64)>], failed: usize, err: &mut GroupError) {
        let now = self.retired_ranges();
        let lost = |m: usize| before[m].iter().any(|r| !now[m].contains(r));
        if !(0..failed).any(lost) {
            return;
        }
        for (m, arena) in self.members.iter().enumerate() {
            if before[m].iter().any(|r| now[m].contains(r)) {
                if let Err(e) = arena.release_retired() {
                    err.undo_failures.push((m, e));
                }
            }
        }
    }

    fn entry(&self, id: GroupId) -> GroupResult<Arc<Mutex<Entry>>> {
        let t = self.entries.lock().map_err(|_| poisoned())?;
        t.get(&id.0).cloned().ok_or_else(|| GroupError::group(Error::UnknownAllocation(id.0)))
    }

    /// Resizes every member's allocation to `new_size`; returns each
    /// member's (maybe new) address. All or nothing: a failure on member
    /// `k` resizes members `0..k` back to the old size (see the module docs
    /// for what that restores).
    pub fn resize(&self, id: GroupId, new_size: u64) -> GroupResult<Vec<u64>> {
        let _scope = OpScope::enter(self.key)?;
        let entry = self.entry(id)?;
        let mut e = entry.lock().map_err(|_| poisoned())?;
        if e.freed {
            return Err(GroupError::group(Error::UnknownAllocation(id.0)));
        }
        let old = e.size;
        let mut ptrs = Vec::with_capacity(self.members.len());
        let mut reserved = Vec::with_capacity(self.members.len());
        let retired = self.retired_ranges();
        for (k, arena) in self.members.iter().enumerate() {
            // The reservation before: an undo trims one extended in place.
            reserved.push(arena.query(e.ids[k]).map(|i| i.reserved_bytes).ok());
            match arena.resize(e.ids[k], new_size) {
                Ok(p) => ptrs.push(p),
                Err(err) => {
                    let mut err = GroupError::member(k, err);
                    for (j, (member, &was)) in self.members.iter().zip(&reserved).take(k).enumerate() {
                        let undone = member.resize(e.ids[j], old).and_then(|_| match was {
                            Some(r) => member.trim_reservation(e.ids[j], r),
                            None => Ok(()),
                        });
                        if let Err(u) = undone {
                            err.undo_failures.push((j, u));
                        }
                    }
                    self.release_retired_like_the_undone(&retired, k, &mut err);
                    return Err(err);
                }
            }
        }
        e.size = new_size;
        Ok(ptrs)
    }

    /// Frees the allocation on every member (see the module docs: every
    /// member is checked first, so a stale member fails the call before
    /// anything is freed).
    pub fn free(&self, id: GroupId) -> GroupResult<()> {
        let _scope = OpScope::enter(self.key)?;
        let entry = self.entry(id)?;
        let mut e = entry.lock().map_err(|_| poisoned())?;
        if e.freed {
            return Err(GroupError::group(Error::UnknownAllocation(id.0)));
        }
        for (k, arena) in self.members.iter().enumerate() {
            arena.query(e.ids[k]).map_err(|err| GroupError::member(k, err))?;
        }
        e.freed = true;
        if let Ok(mut t) = self.entries.lock() {
            t.remove(&id.0);
        }
        let mut first: Option<GroupError> = None;
        for (k, arena) in self.members.iter().enumerate() {
            if let Err(err) = arena.free(e.ids[k]) {
                first.get_or_insert(GroupError::member(k, err));
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Every member's facts about the allocation (member order).
    pub fn query(&self, id: GroupId) -> GroupResult<Vec<AllocInfo>> {
        let entry = self.entry(id)?;
        let e = entry.lock().map_err(|_| poisoned())?;
        if e.freed {
            return Err(GroupError::group(Error::UnknownAllocation(id.0)));
        }
        self.members
            .iter()
            .enumerate()
            .map(|(k, a)| a.query(e.ids[k]).map_err(|err| GroupError::member(k, err)))
            .collect()
    }

    /// Each member's id of the allocation (for the member's own `read`,
    /// `write`, `pin`).
    pub fn member_ids(&self, id: GroupId) -> GroupResult<Vec<Id>> {
        let entry = self.entry(id)?;
        let e = entry.lock().map_err(|_| poisoned())?;
        if e.freed {
            return Err(GroupError::group(Error::UnknownAllocation(id.0)));
        }
        Ok(e.ids.clone())
    }

    /// Live group allocations.
    pub fn live_allocations(&self) -> usize {
        self.entries.lock().map(|t| t.len()).unwrap_or(0)
    }

    /// Each member's stats (member order).
    pub fn stats(&self) -> GroupResult<Vec<Stats>> {
        self.members.iter().enumerate().map(|(k, a)| a.stats().map_err(|e| GroupError::member(k, e))).collect()
    }

    /// A JSON object: `devices`, the group allocations (`id`, `size`, and
    /// each member's `ids`), and `members`, each member's own snapshot
    /// (the arena snapshot's format), in member order.
    pub fn snapshot_json(&self) -> GroupResult<String> {
        use std::fmt::Write;
        let mut allocs: Vec<(u64, u64, Vec<Id>)> = {
            let t = self.entries.lock().map_err(|_| poisoned())?;
            t.iter()
                .filter_map(|(&raw, e)| e.lock().ok().filter(|e| !e.freed).map(|e| (raw, e.size, e.ids.clone())))
                .collect()
        };
        allocs.sort_by_key(|a| a.0);
        let mut s = String::from("{\"devices\":[");
        for (i, d) in self.devices.iter().enumerate() {
            let _ = write!(s, "{}{d}", if i > 0 { "," } else { "" });
        }
        s.push_str("],\"allocations\":[");
        for (i, (raw, size, ids)) in allocs.iter().enumerate() {
            let _ = write!(s, "{}{{\"id\":{raw},\"size\":{size},\"ids\":[", if i > 0 { "," } else { "" });
            for (j, id) in ids.iter().enumerate() {
                let _ = write!(s, "{}{}", if j > 0 { "," } else { "" }, id.get());
            }
            s.push_str("]}");
        }
        s.push_str("],\"members\":[");
        for (k, a) in self.members.iter().enumerate() {
            if k > 0 {
                s.push(',');
            }
            s.push_str(&a.snapshot_json().map_err(|e| GroupError::member(k, e))?);
        }
        s.push_str("]}");
        Ok(s)
    }
}

fn check_devices(devices: &[i32]) -> GroupResult<()> {
    if devices.is_empty() {
        return Err(GroupError::group(Error::invalid("a group needs at least one device")));
    }
    let mut seen = devices.to_vec();
    seen.sort_unstable();
    if seen.windows(2).any(|w| w[0] == w[1]) {
        return Err(GroupError::group(Error::invalid(format!("the group's devices {devices:?} repeat one"))));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const _: () = {
        const fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Group>();
    };

    #[test]
    fn errors_name_the_member_and_keep_the_status() {
        let e = GroupError::member(2, Error::OutOfMemory("x".into()));
        assert_eq!(e.to_string(), "group member 2: out of memory: x");
        assert_eq!(e.status(), Status::OutOfMemory);
        let as_error: Error = e.into();
        assert_eq!(as_error, Error::OutOfMemory("group member 2: out of memory: x".into()));
        let e = GroupError::member(1, Error::Pinned(7));
        assert_eq!(Error::from(e), Error::Pinned(7));
    }

    #[test]
    fn devices_must_be_distinct_and_present() {
        assert!(check_devices(&[]).is_err());
        assert!(check_devices(&[0, 1, 0]).is_err());
        assert!(check_devices(&[3, 1, 2]).is_ok());
    }
}
