//! Tensor-parallel KV managers for `kv_serving --tp N`: a request's KV is
//! sharded over N devices, each holding 1/N of every token's KV (the
//! token-major layout, one allocation per request per device), and a step
//! needs its shard on every device.
//!
//! - `tp-arena`: a [`vmm_arena::Group`] of N arenas; `alloc_growable`,
//!   `resize` and `free` act on every member, all or nothing (a member that
//!   fails undoes the others).
//! - `tp-pytorch-caching`: N independent models of PyTorch's caching
//!   allocator, one per device (each request's shard a contiguous tensor
//!   grown by doubling with a copy, as `pytorch-caching`). An engine does
//!   what the group does by hand: a failed admission frees the shards the
//!   devices before it took; a failed growth preempts the request (the
//!   replay frees it on every device).
//!
//! **Activation noise.** Ranks differ: their activation memory does not
//! follow the same sizes step by step. Between steps every device frees its
//! previous activations and allocates new ones, a few tensors whose total
//! is drawn around a mean from a generator seeded per device (the same
//! seeds for both managers), from the same allocator as the KV (so in
//! PyTorch's model they interleave with the KV and fragment it). Each
//! device's capacity is the KV capacity plus the largest activation total,
//! so activations alone always fit. An activation allocation that fails is
//! counted (`activation_failures`): the step would fail on that device.
//!
//! Memory figures are per device: `physical_bytes` is the fullest device's
//! (the one that binds), the peaks of each device are in `extra`.
//!
//! **What is reported** beside the replay's figures (`extra`): every failed
//! admission or growth, by the member that failed, and how many of them
//! failed on a member after the members before it had room (`bucket`): the
//! step fails although those devices could serve it.

use vmm_arena::{Arena, ArenaConfig, Error, Group, GroupId, Id};

use super::caching::CachingAllocator;
use super::counted::{is_host_limit, Calls};
use super::managers::{discard, host_budget, new_device, Dev, Fail, KvManager, KvShape, TorchMgr};
use super::trace::Request;
use super::util::{mix64, Rng};

/// Managers `--tp` replays (a tensor-parallel version of each).
pub const TP_MANAGERS: [&str; 2] = ["arena", "pytorch-caching"];

/// Activation noise of one run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Noise {
    /// Mean activation bytes per device per step.
    pub mean_bytes: u64,
    /// Each step's total is `mean × (1 ± spread)`, uniform.
    pub spread: f64,
    /// Tensors the total is cut into (random proportions).
    pub tensors: u32,
    /// Base seed; device `m` draws from `mix64(seed ^ m)`.
    pub seed: u64,
}

impl Noise {
    /// The most a step can allocate on one device.
    pub fn max_bytes(&self) -> u64 {
        (self.mean_bytes as f64 * (1.0 + self.spread)).ceil() as u64 + self.tensors as u64 * (2 << 20)
    }

    fn rngs(&self, members: usize) -> Vec<Rng> {
        (0..members as u64).map(|m| Rng::new(mix64(self.seed ^ (m + 1).wrapping_mul(0x9e37_79b9)))).collect()
    }
}

/// One step's activation tensor sizes on a device.
fn draw(noise: &Noise, rng: &mut Rng) -> Vec<u64> {
    if noise.mean_bytes == 0 || noise.tensors == 0 {
        return Vec::new();
    }
    let total = noise.mean_bytes as f64 * (1.0 + noise.spread * (2.0 * rng.f64() - 1.0));
    let weights: Vec<f64> = (0..noise.tensors).map(|_| 0.25 + rng.f64()).collect();
    let sum: f64 = weights.iter().sum();
    weights.iter().map(|w| ((total * w / sum) as u64).max(1)).collect()
}

/// The shape of one device's shard: 1/N of every token's KV.
pub fn shard_shape(shape: KvShape, members: usize) -> Result<KvShape, String> {
    if !shape.layout.one_allocation() {
        return Err("--tp shards the token-major and block-in-chunk layouts only".into());
    }
    let per = shape.kv_bytes_per_token / members as u64;
    if per < 8 || shape.kv_bytes_per_token % members as u64 != 0 {
        return Err(format!("{} KV bytes per token do not split into {members} shards", shape.kv_bytes_per_token));
    }
    Ok(KvShape { kv_bytes_per_token: per, ..shape })
}

/// Failures of the group's operations, by member.
#[derive(Clone, Debug, Default)]
struct Failures {
    by_member: Vec<u64>,
    /// Failures on a member after the members before it had succeeded.
    bucket: u64,
    activation: Vec<u64>,
    /// Activation allocations that failed although the device had room.
    activation_fragmentation: u64,
}

impl Failures {
    fn new(members: usize) -> Failures {
        Failures { by_member: vec![0; members], bucket: 0, activation: vec![0; members], activation_fragmentation: 0 }
    }

    fn note(&mut self, member: usize) {
        self.by_member[member] += 1;
        if member > 0 {
            self.bucket += 1;
        }
    }

    fn extra(&self, members: usize) -> Vec<(String, String)> {
        let list = |v: &[u64]| format!("[{}]", v.iter().map(u64::to_string).collect::<Vec<_>>().join(","));
        vec![
            ("tp_members".into(), members.to_string()),
            ("tp_failures_by_member".into(), list(&self.by_member)),
            ("tp_failures".into(), self.by_member.iter().sum::<u64>().to_string()),
            ("tp_bucket_failures".into(), self.bucket.to_string()),
            ("tp_activation_failures".into(), list(&self.activation)),
            ("tp_activation_fragmentation".into(), self.activation_fragmentation.to_string()),
        ]
    }
}

/// The tag every shard read back, in shard order: None at the first shard
/// that could not be read; at the first that disagrees, a value other than
/// the first shard's (an integrity error); None with no shards.
fn shards_agree(tags: impl Iterator<Item = Option<u64>>) -> Option<u64> {
    let mut first = None;
    for v in tags {
        let v = v?;
        match first {
            None => first = Some(v),
            Some(f) if f != v => return Some(!f),
            Some(_) => {}
        }
    }
    first
}

fn sum_calls(devs: &[Dev]) -> Calls {
    let mut t = Calls::default();
    for d in devs {
        let c = d.calls();
        t.reserve += c.reserve;
        t.free_reservation += c.free_reservation;
        t.create += c.create;
        t.create_failed += c.create_failed;
        t.release += c.release;
        t.map += c.map;
        t.set_access += c.set_access;
        t.unmap += c.unmap;
        t.synchronize += c.synchronize;
        t.data += c.data;
        t.create_chunks += c.create_chunks;
        t.release_chunks += c.release_chunks;
        t.map_chunks += c.map_chunks;
        t.set_access_chunks += c.set_access_chunks;
        t.unmap_chunks += c.unmap_chunks;
    }
    t
}

// ---------------------------------------------------------------- arena group

/// `tp-arena`: one growable allocation per request on every member, made,
/// grown and freed by the group, all or nothing.
pub struct TpArenaMgr {
    group: Group,
    devs: Vec<Dev>,
    shard: KvShape,
    chunk: u64,
    capacity: u64,
    seqs: Vec<Option<(GroupId, Vec<Id>, u64)>>,
    noise: Noise,
    rngs: Vec<Rng>,
    activations: Vec<Vec<Id>>,
    failures: Failures,
    discard: bool,
}

impl TpArenaMgr {
    /// `capacity`: KV bytes per device (each device gets the activations' room on top).
    pub fn new(
        shape: KvShape,
        members: usize,
        capacity: u64,
        reserve: u64,
        retain: u64,
        noise: Noise,
    ) -> Result<TpArenaMgr, String> {
        let shard = shard_shape(shape, members)?;
        let device_capacity = capacity + noise.max_bytes();
        let mut devs = Vec::new();
        let mut arenas = Vec::new();
        for _ in 0..members {
            let dev = new_device(device_capacity)?;
            let cfg = ArenaConfig {
                capacity_bytes: device_capacity,
                reserve_bytes: reserve,
                retain_bytes: retain,
                ..ArenaConfig::default()
            };
            arenas.push(Arena::with_driver(dev.clone(), cfg).map_err(|e| format!("arena: {e}"))?);
            devs.push(dev);
        }
        let group = Group::from_arenas(arenas).map_err(|e| format!("group: {e}"))?;
        let chunk = group.member(0).chunk_bytes();
        Ok(TpArenaMgr {
            group,
            devs,
            shard,
            chunk,
            capacity: device_capacity / chunk * chunk,
            seqs: Vec::new(),
            rngs: noise.rngs(members),
            noise,
            activations: vec![Vec::new(); members],
            failures: Failures::new(members),
            discard: false,
        })
    }

    fn bytes_for(&self, tokens: u64) -> u64 {
        (tokens * self.shard.bpt()).div_ceil(self.chunk).max(1) * self.chunk
    }

    fn fail(&mut self, e: vmm_arena::GroupError, needed: u64) -> Fail {
        let m = e.member.unwrap_or(0);
        self.failures.note(m);
        let mapped = self.group.member(m).stats().map(|s| s.mapped_bytes).unwrap_or(0);
        let host_limit = is_host_limit(&e.error);
        let fragmentation = !host_limit
            && match e.error {
                Error::OutOfAddressSpace(_) => true,
                _ => self.capacity.saturating_sub(mapped) >= needed,
            };
        Fail { fragmentation, host_limit, message: e.to_string() }
    }
}

fn slot<T>(v: &mut Vec<Option<T>>, seq: usize) -> &mut Option<T> {
    if v.len() <= seq {
        v.resize_with(seq + 1, || None);
    }
    &mut v[seq]
}

impl KvManager for TpArenaMgr {
    fn name(&self) -> &'static str {
        "tp-arena"
    }

    fn admit(&mut self, seq: usize, tokens: u64, _q: &Request) -> Result<u64, Fail> {
        let size = self.bytes_for(tokens);
        let max = size.max(self.bytes_for(self.shard.max_context));
        match self.group.alloc_growable(size, max) {
            Ok((gid, _)) => {
                let ids = self.group.member_ids(gid).expect("a live group allocation");
                *slot(&mut self.seqs, seq) = Some((gid, ids, size / self.shard.bpt()));
                Ok(0)
            }
            Err(e) => Err(self.fail(e, size)),
        }
    }

    fn grow(&mut self, seq: usize, tokens: u64, _stored: u64) -> Result<(), Fail> {
        let (gid, _, cap) = self.seqs[seq].as_ref().expect("live sequence").clone();
        if tokens <= cap {
            return Ok(());
        }
        let new_size = self.bytes_for(tokens);
        match self.group.resize(gid, new_size) {
            Ok(_) => {
                self.seqs[seq].as_mut().expect("live").2 = new_size / self.shard.bpt();
                Ok(())
            }
            Err(e) => {
                let old = self.bytes_for(cap);
                Err(self.fail(e, new_size - old))
            }
        }
    }

    fn free(&mut self, seq: usize) {
        if let Some((gid, ids, _)) = self.seqs[seq].take() {
            if self.discard {
                for (m, id) in ids.iter().enumerate() {
                    if let Ok(q) = self.group.member(m).query(*id) {
                        discard(q.ptr, q.mapped_bytes);
                    }
                }
            }
            self.group.free(gid).expect("free of a live group allocation");
        }
    }

    fn write_tag(&mut self, seq: usize, t: u64, tag: u64) -> bool {
        let ids = &self.seqs[seq].as_ref().expect("live").1;
        let off = t * self.shard.bpt();
        ids.iter().enumerate().all(|(m, &id)| self.group.member(m).write(id, off, &tag.to_le_bytes()).is_ok())
    }

    fn read_tag(&mut self, seq: usize, t: u64) -> Option<u64> {
        let ids = &self.seqs[seq].as_ref().expect("live").1;
        let off = t * self.shard.bpt();
        shards_agree(ids.iter().enumerate().map(|(m, &id)| {
            let mut b = [0u8; 8];
            self.group.member(m).read(id, off, &mut b).ok()?;
            Some(u64::from_le_bytes(b))
        }))
    }

    fn physical_bytes(&self) -> u64 {
        self.devs.iter().map(|d| d.live_bytes()).max().unwrap_or(0)
    }

    fn peak_physical_bytes(&self) -> u64 {
        self.devs.iter().map(|d| d.peak_bytes()).max().unwrap_or(0)
    }

    fn calls(&self) -> Calls {
        sum_calls(&self.devs)
    }

    fn bytes_copied(&self) -> u64 {
        0
    }

    fn moves(&self) -> u64 {
        self.group.stats().map(|v| v.iter().map(|s| s.moves).sum()).unwrap_or(0)
    }

    fn housekeeping(&mut self) {
        let budget = host_budget(self.capacity);
        self.discard = self.devs.iter().any(|d| d.inner().allocated_file_bytes().unwrap_or(0) > budget);
    }

    fn between_steps(&mut self) {
        for m in 0..self.devs.len() {
            let arena = self.group.member(m);
            let _ = arena.release_retired();
            for id in self.activations[m].drain(..) {
                arena.free(id).expect("free of an activation");
            }
            for size in draw(&self.noise, &mut self.rngs[m]) {
                match arena.alloc(size) {
                    Ok((id, _)) => self.activations[m].push(id),
                    Err(_) => {
                        self.failures.activation[m] += 1;
                        let s = arena.stats().expect("stats");
                        if s.capacity_bytes.saturating_sub(s.mapped_bytes) >= size.div_ceil(self.chunk) * self.chunk {
                            self.failures.activation_fragmentation += 1;
                        }
                    }
                }
            }
        }
    }

    fn extra(&self) -> Vec<(String, String)> {
        let mut v = self.failures.extra(self.devs.len());
        let peaks: Vec<String> = self.devs.iter().map(|d| d.peak_bytes().to_string()).collect();
        v.push(("tp_peak_physical_by_member".into(), format!("[{}]", peaks.join(","))));
        v.push(("moves".into(), self.moves().to_string()));
        v
    }
}

// ------------------------------------------------------- PyTorch, per device

/// `tp-pytorch-caching`: one PyTorch caching-allocator model per device.
pub struct TpTorchMgr {
    members: Vec<TorchMgr>,
    devs: Vec<Dev>,
    noise: Noise,
    rngs: Vec<Rng>,
    activations: Vec<Vec<u64>>,
    failures: Failures,
}

impl TpTorchMgr {
    /// `capacity`: KV bytes per device (each device gets the activations' room on top).
    pub fn new(shape: KvShape, members: usize, capacity: u64, noise: Noise) -> Result<TpTorchMgr, String> {
        let shard = shard_shape(shape, members)?;
        let device_capacity = capacity + noise.max_bytes();
        let mut v = Vec::new();
        let mut devs = Vec::new();
        for _ in 0..members {
            let t = TorchMgr::new("pytorch-caching", shard, device_capacity, false)?;
            devs.push(t.device().clone());
            v.push(t);
        }
        Ok(TpTorchMgr {
            members: v,
            devs,
            rngs: noise.rngs(members),
            noise,
            activations: vec![Vec::new(); members],
            failures: Failures::new(members),
        })
    }

    fn allocator(&mut self, m: usize) -> &mut CachingAllocator<Dev> {
        self.members[m].allocator_mut()
    }
}

impl KvManager for TpTorchMgr {
    fn name(&self) -> &'static str {
        "tp-pytorch-caching"
    }

    fn admit(&mut self, seq: usize, tokens: u64, q: &Request) -> Result<u64, Fail> {
        for m in 0..self.members.len() {
            if let Err(f) = self.members[m].admit(seq, tokens, q) {
                // What an engine does by hand: give back the shards taken.
                for done in &mut self.members[..m] {
                    done.free(seq);
                }
                self.failures.note(m);
                return Err(Fail { message: format!("device {m}: {}", f.message), ..f });
            }
        }
        Ok(0)
    }

    fn grow(&mut self, seq: usize, tokens: u64, stored: u64) -> Result<(), Fail> {
        for m in 0..self.members.len() {
            // A device that grew already keeps its bigger tensor: the replay
            // preempts a request and retries, or frees this one everywhere.
            if let Err(f) = self.members[m].grow(seq, tokens, stored) {
                self.failures.note(m);
                return Err(Fail { message: format!("device {m}: {}", f.message), ..f });
            }
        }
        Ok(())
    }

    fn free(&mut self, seq: usize) {
        for t in &mut self.members {
            t.free(seq);
        }
    }

    fn write_tag(&mut self, seq: usize, t: u64, tag: u64) -> bool {
        self.members.iter_mut().all(|m| m.write_tag(seq, t, tag))
    }

    fn read_tag(&mut self, seq: usize, t: u64) -> Option<u64> {
        shards_agree(self.members.iter_mut().map(|m| m.read_tag(seq, t)))
    }

    fn physical_bytes(&self) -> u64 {
        self.devs.iter().map(|d| d.live_bytes()).max().unwrap_or(0)
    }

    fn peak_physical_bytes(&self) -> u64 {
        self.devs.iter().map(|d| d.peak_bytes()).max().unwrap_or(0)
    }

    fn calls(&self) -> Calls {
        sum_calls(&self.devs)
    }

    fn bytes_copied(&self) -> u64 {
        self.members.iter().map(|m| m.bytes_copied()).sum()
    }

    fn moves(&self) -> u64 {
        0
    }

    fn housekeeping(&mut self) {
        for m in &mut self.members {
            m.housekeeping();
        }
    }

    fn between_steps(&mut self) {
        for m in 0..self.members.len() {
            let old = std::mem::take(&mut self.activations[m]);
            for p in old {
                self.allocator(m).free(p);
            }
            let sizes = draw(&self.noise, &mut self.rngs[m]);
            for size in sizes {
                match self.allocator(m).malloc(size) {
                    Ok(p) => self.activations[m].push(p),
                    Err(oom) => {
                        self.failures.activation[m] += 1;
                        if oom.is_fragmentation() {
                            self.failures.activation_fragmentation += 1;
                        }
                    }
                }
            }
        }
    }

    fn extra(&self) -> Vec<(String, String)> {
        let mut v = self.failures.extra(self.members.len());
        let peaks: Vec<String> = self.devs.iter().map(|d| d.peak_bytes().to_string()).collect();
        v.push(("tp_peak_physical_by_member".into(), format!("[{}]", peaks.join(","))));
        let ooms: u64 = self
            .members
            .iter()
            .map(|m| {
                m.extra().iter().find(|(k, _)| k == "num_ooms").and_then(|(_, x)| x.parse::<u64>().ok()).unwrap_or(0)
            })
            .sum();
        v.push(("num_ooms".into(), ooms.to_string()));
        v
    }
}

/// Builds a `--tp` manager by its base name (see [`TP_MANAGERS`]).
#[allow(clippy::too_many_arguments)]
pub fn build(
    name: &str,
    shape: KvShape,
    members: usize,
    capacity: u64,
    reserve: u64,
    retain: u64,
    noise: Noise,
) -> Result<Box<dyn KvManager + Send>, String> {
    Ok(match name {
        "arena" => Box::new(TpArenaMgr::new(shape, members, capacity, reserve, retain, noise)?),
        "pytorch-caching" => Box::new(TpTorchMgr::new(shape, members, capacity, noise)?),
        other => return Err(format!("--tp replays {} only, not {other:?}", TP_MANAGERS.join(" and "))),
    })
}
