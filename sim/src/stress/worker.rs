//! One worker thread: its random operations on the shared arena and the checks after each.

use super::*;

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn below(x: &mut u64, n: u64) -> u64 {
    splitmix(x) % n.max(1)
}

/// The pattern byte of an allocation with `seed` at `offset`.
fn pattern(seed: u64, offset: u64) -> u8 {
    let mut x = seed ^ (offset >> 3).wrapping_mul(0xd6e8_feb8_6659_fd93);
    (splitmix(&mut x) >> ((offset & 7) * 8)) as u8
}

/// The patterned windows of an allocation of `size` bytes, clipped to `[lo, hi)`.
fn windows(chunk: u64, size: u64, lo: u64, hi: u64) -> Vec<(u64, u64)> {
    let hi = hi.min(size);
    let mut out = Vec::new();
    if lo >= hi {
        return out;
    }
    let w = WINDOW.min(chunk / 4).max(1);
    for k in lo / chunk..hi.div_ceil(chunk) {
        let base = k * chunk;
        for s in [base, base + chunk / 2, base + chunk - w] {
            let (a, b) = (s.max(lo), (s + w).min(hi));
            if a < b {
                out.push((a, b));
            }
        }
    }
    out
}

impl Worker<'_> {
    fn write_range(&mut self, o: usize, lo: u64, hi: u64) {
        let (id, seed, size) = (self.objs[o].id, self.objs[o].seed, self.objs[o].size);
        for (a, b) in windows(self.chunk, size, lo, hi) {
            let buf: Vec<u8> = (a..b).map(|off| pattern(seed, off)).collect();
            match self.arena.write(id, a, &buf) {
                Ok(()) => self.t.written += b - a,
                Err(e) => self.t.error(format!("write {id} [{a}, {b}) of {size}: {e}")),
            }
        }
    }

    pub(super) fn verify(&mut self, o: usize, what: &str) {
        let (id, seed, size) = (self.objs[o].id, self.objs[o].seed, self.objs[o].size);
        let mut buf = Vec::new();
        for (a, b) in windows(self.chunk, size, 0, size) {
            buf.resize((b - a) as usize, 0);
            if let Err(e) = self.arena.read(id, a, &mut buf) {
                self.t.error(format!("{what}: read {id} [{a}, {b}) of {size}: {e}"));
                return;
            }
            if let Some(i) = (a..b).position(|off| buf[(off - a) as usize] != pattern(seed, off)) {
                self.t.error(format!("{what}: {id} (size {size}) has a wrong byte at offset {}", a + i as u64));
                return;
            }
            self.t.verified += b - a;
        }
    }

    /// `query` agrees with the pointer table, the size, the pin, and a pinned allocation's address.
    pub(super) fn check_query(&mut self, o: usize, what: &str) {
        let (id, size, pinned_at) = (self.objs[o].id, self.objs[o].size, self.objs[o].pinned_at);
        let moves_of = |t: &Table| t.ptrs.get(&id.get()).map(|e| (e.ptr, e.moves));
        let before = moves_of(&self.table.lock().unwrap());
        let info = match self.arena.query(id) {
            Ok(i) => i,
            Err(e) => return self.t.error(format!("{what}: query {id}: {e}")),
        };
        let after = moves_of(&self.table.lock().unwrap());
        match (before, after) {
            (Some((_, m1)), Some((p, m2))) if m1 == m2 => {
                self.t.ptr_checks += 1;
                if p != info.ptr {
                    self.t.error(format!("{what}: {id} is at {:#x} but the move table says {p:#x}", info.ptr));
                }
            }
            (Some(_), Some(_)) => self.t.ptr_raced += 1,
            _ => self.t.error(format!("{what}: {id} is missing from the pointer table")),
        }
        // Whole chunks, or (small, slab-packed) a size class of at most half a chunk.
        let mapped_ok = if info.mapped_bytes >= self.chunk {
            info.mapped_bytes == size.div_ceil(self.chunk) * self.chunk
        } else {
            info.mapped_bytes >= size && info.mapped_bytes <= self.chunk / 2 && !info.growable
        };
        if info.size != size || !mapped_ok || info.growable != self.objs[o].growable {
            self.t.error(format!(
                "{what}: {id} has size {} mapped {} growable {} (expected {size}, whole chunks or a small class, {})",
                info.size, info.mapped_bytes, info.growable, self.objs[o].growable
            ));
        }
        if info.pinned != pinned_at.is_some() {
            self.t.error(format!("{what}: {id} pinned is {} (expected {})", info.pinned, pinned_at.is_some()));
        }
        if let Some(p) = pinned_at {
            if info.ptr != p {
                self.t.error(format!("{what}: pinned {id} moved from {p:#x} to {:#x}", info.ptr));
            }
        }
    }

    /// With one thread and nothing pinned, an allocation refused for address
    /// space must not succeed after an explicit `compact()`: the contract says
    /// holes are never a reason to fail, the arena compacts before it refuses.
    /// Returns the allocation if the retry succeeded (and counts an error).
    fn check_address_space(&mut self, e: &Error, size: u64, max: Option<u64>) -> Option<(Id, u64)> {
        if !matches!(e, Error::OutOfAddressSpace(_))
            || self.cfg.threads != 1
            || self.cfg.pins
            || self.cfg.no_implicit_moves
        {
            return None;
        }
        let before = self.arena.stats().ok()?;
        if let Err(e) = self.arena.compact() {
            self.t.error(format!("compact: {e}"));
            return None;
        }
        let retry = match max {
            None => self.arena.alloc(size),
            Some(m) => self.arena.alloc_growable(size, m),
        };
        let r = retry.ok()?;
        self.t.error(format!(
            "alloc{}({size}{}) refused ({e}) with {} bytes of free and {} of retired address space and nothing \
             pinned, but succeeded after compact()",
            if max.is_some() { "_growable" } else { "" },
            max.map(|m| format!(", {m}")).unwrap_or_default(),
            before.free_va_bytes,
            before.retired_va_bytes
        ));
        Some(r)
    }

    fn random_size(&mut self) -> u64 {
        let max = self.cfg.max_alloc_bytes.max(1);
        match below(&mut self.rng, 10) {
            0..=4 => 1 + below(&mut self.rng, self.chunk.min(max)),
            5..=8 => 1 + below(&mut self.rng, (4 * self.chunk).min(max)),
            _ => 1 + below(&mut self.rng, max),
        }
    }

    fn add(&mut self, id: Id, ptr: u64, size: u64, growable: bool) {
        self.table.lock().unwrap().ptrs.entry(id.get()).or_insert(Entry { ptr, moves: 0, pinned: false });
        let seed = splitmix(&mut self.rng);
        self.objs.push(Obj { id, size, seed, growable, pinned_at: None });
        let o = self.objs.len() - 1;
        self.write_range(o, 0, size);
    }

    pub(super) fn step(&mut self) {
        let n = self.objs.len();
        let full = n >= self.cfg.max_live_per_thread;
        let pick = below(&mut self.rng, 1000);
        let o = if n > 0 { below(&mut self.rng, n as u64) as usize } else { 0 };
        let op = match pick {
            _ if n == 0 => 0,
            0..=149 if !full => 0,
            150..=249 if !full => 1,
            0..=249 => 3,
            250..=499 => 2,
            500..=629 => 3,
            630..=699 => 4,
            700..=829 => 5,
            830..=899 => 6,
            900..=929 if self.cfg.pins => 7,
            930..=959 if self.cfg.pins => 8,
            900..=959 => 6,
            960..=969 => 9,
            970..=979 => 10,
            980..=989 => 11,
            _ => 12,
        };
        self.t.ops[op] += 1;
        match op {
            0 => {
                let size = self.random_size();
                match self.arena.alloc(size) {
                    Ok((id, ptr)) => self.add(id, ptr, size, false),
                    Err(e) => {
                        self.t.refusal("alloc", &e);
                        if let Some((id, ptr)) = self.check_address_space(&e, size, None) {
                            self.add(id, ptr, size, false);
                        }
                    }
                }
            }
            1 => {
                let size = self.random_size();
                let max = size * (1 + below(&mut self.rng, 8));
                match self.arena.alloc_growable(size, max) {
                    Ok((id, ptr)) => self.add(id, ptr, size, true),
                    Err(e) => {
                        self.t.refusal("alloc_growable", &e);
                        if let Some((id, ptr)) = self.check_address_space(&e, size, Some(max)) {
                            self.add(id, ptr, size, true);
                        }
                    }
                }
            }
            2 => {
                let old = self.objs[o].size;
                let new = match below(&mut self.rng, 3) {
                    0 => 1 + below(&mut self.rng, old),
                    _ if self.objs[o].growable => old + 1 + below(&mut self.rng, 2 * self.chunk),
                    _ => self.random_size(),
                };
                let id = self.objs[o].id;
                match self.arena.resize(id, new) {
                    Ok(ptr) => {
                        if let Some(p) = self.objs[o].pinned_at {
                            if p != ptr {
                                self.t.error(format!("resize moved pinned {id} from {p:#x} to {ptr:#x}"));
                            }
                        }
                        self.objs[o].size = new;
                        if new > old {
                            self.write_range(o, old, new);
                        }
                        self.verify(o, "after resize");
                    }
                    Err(e) => {
                        self.t.refusal("resize", &e);
                        // A failed call leaves the allocation as it was.
                        self.check_query(o, "after a failed resize");
                        self.verify(o, "after a failed resize");
                    }
                }
            }
            3 => {
                let obj = self.objs.swap_remove(o);
                if obj.pinned_at.is_some() {
                    if let Some(e) = self.table.lock().unwrap().ptrs.get_mut(&obj.id.get()) {
                        e.pinned = false;
                    }
                }
                match self.arena.free(obj.id) {
                    Ok(()) => {
                        self.table.lock().unwrap().ptrs.remove(&obj.id.get());
                        if !matches!(self.arena.query(obj.id), Err(Error::UnknownAllocation(_))) {
                            self.t.error(format!("freed {} still answers query", obj.id));
                        }
                    }
                    Err(e) => self.t.error(format!("free {}: {e}", obj.id)),
                }
            }
            4 => {
                self.objs[o].seed = splitmix(&mut self.rng);
                let size = self.objs[o].size;
                self.write_range(o, 0, size);
            }
            5 => {
                self.verify(o, "verify");
                self.check_query(o, "verify");
            }
            6 => self.check_query(o, "query"),
            7 => {
                let pinned = self.objs.iter().filter(|x| x.pinned_at.is_some()).count();
                if self.objs[o].pinned_at.is_none() && pinned < 2 {
                    let id = self.objs[o].id;
                    match self.arena.pin(id) {
                        Ok(()) => {
                            // Moves before pin() returned were reported before it returned.
                            let ptr = {
                                let mut t = self.table.lock().unwrap();
                                let e = t.ptrs.get_mut(&id.get()).expect("live allocation in the table");
                                e.pinned = true;
                                e.ptr
                            };
                            self.objs[o].pinned_at = Some(ptr);
                            self.check_query(o, "after pin");
                        }
                        Err(e) => self.t.error(format!("pin {id}: {e}")),
                    }
                }
            }
            8 => {
                if let Some(o) = self.objs.iter().position(|x| x.pinned_at.is_some()) {
                    let id = self.objs[o].id;
                    if let Some(e) = self.table.lock().unwrap().ptrs.get_mut(&id.get()) {
                        e.pinned = false;
                    }
                    match self.arena.unpin(id) {
                        Ok(()) => self.objs[o].pinned_at = None,
                        Err(e) => self.t.error(format!("unpin {id}: {e}")),
                    }
                }
            }
            9 => match self.arena.compact() {
                Ok(r) => {
                    self.t.compact_moved += r.moved_allocations;
                    if r.largest_free_va_after < r.largest_free_va_before {
                        self.t.compact_shrank += 1;
                    }
                    self.verify(o, "after compact");
                }
                Err(e) => self.t.error(format!("compact: {e}")),
            },
            10 => {
                let keep = below(&mut self.rng, self.cfg.capacity_bytes / 4 + 1);
                match self.arena.trim(keep) {
                    Ok(b) => self.t.trimmed += b,
                    Err(e) => self.t.error(format!("trim({keep}): {e}")),
                }
            }
            11 => {
                if let Err(e) = self.arena.release_retired() {
                    self.t.error(format!("release_retired: {e}"));
                }
                self.verify(o, "after release_retired");
            }
            _ => match self.arena.stats() {
                Ok(s) => {
                    if s.mapped_bytes + s.pooled_bytes > s.capacity_bytes
                        || s.peak_physical_bytes > s.capacity_bytes
                        || s.live_bytes > s.mapped_bytes
                        || s.largest_free_va_bytes > s.free_va_bytes
                    {
                        self.t.error(format!("inconsistent stats {s:?}"));
                    }
                }
                Err(e) => self.t.error(format!("stats: {e}")),
            },
        }
    }
}
