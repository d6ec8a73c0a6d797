//! Small allocations packed into shared chunks by size class.
//!
//! An allocation of at most half a chunk (1 MiB with 2 MiB chunks) takes a
//! slot in a *slab*: one chunk, allocated from the arena like any other
//! allocation, cut into equal objects of one size class. Slabs move by
//! remapping like any allocation, and every small allocation in a moved slab
//! moves with it (the move callback fires for each).
//!
//! Classes: multiples of 256 bytes (the alignment the contract promises),
//! four per power of two up to an eighth of a chunk — so a request of 1 KiB
//! or more wastes at most a fifth of its class (less than 256 bytes below
//! 1 KiB) — and above that
//! the chunk divided by 7, 6, ..., 2 (rounded down to 256), so a slab of a
//! large class wastes at most 256 bytes per object at its tail instead of
//! up to a third of the chunk.
//!
//! Slabs are keyed by tag as well as class: small allocations of different
//! tags never share a slab, so a tag's slabs sleep and wake with it (see
//! `Arena::sleep`) and no other tag's bytes are in them.
//!
//! This module is bookkeeping only: which slab and index an allocation
//! uses. The arena maps slabs and reports moves.

use std::collections::{BTreeMap, BTreeSet};

/// Objects are aligned to this (and class sizes are multiples of it).
pub const SMALL_ALIGN: u64 = 256;

/// The size classes of one chunk size.
#[derive(Clone, Debug)]
pub(crate) struct SizeClasses {
    chunk: u64,
    sizes: Vec<u64>,
}

impl SizeClasses {
    pub fn new(chunk: u64) -> SizeClasses {
        let mut sizes = Vec::new();
        let eighth = chunk / 8;
        let mut base = SMALL_ALIGN;
        'outer: while base < eighth {
            for q in 0..4 {
                let s = (base + base * q / 4) / SMALL_ALIGN * SMALL_ALIGN;
                if s > eighth {
                    break 'outer;
                }
                if sizes.last() != Some(&s) {
                    sizes.push(s);
                }
            }
            base *= 2;
        }
        for n in (2..=8).rev() {
            let s = chunk / n / SMALL_ALIGN * SMALL_ALIGN;
            if s >= SMALL_ALIGN && sizes.last().map_or(true, |&l| s > l) {
                sizes.push(s);
            }
        }
        SizeClasses { chunk, sizes }
    }

    /// The largest small size; larger requests get whole chunks.
    pub fn threshold(&self) -> u64 {
        self.sizes.last().copied().unwrap_or(0)
    }

    /// The class of a request, or `None` if it is not small.
    pub fn class_of(&self, size: u64) -> Option<u16> {
        if size == 0 || size > self.threshold() {
            return None;
        }
        Some(self.sizes.partition_point(|&s| s < size) as u16)
    }

    pub fn size(&self, class: u16) -> u64 {
        self.sizes[class as usize]
    }

    pub fn per_slab(&self, class: u16) -> u32 {
        (self.chunk / self.size(class)) as u32
    }

    #[cfg(test)]
    pub fn count(&self) -> usize {
        self.sizes.len()
    }
}

/// One slab: a chunk-sized arena allocation cut into objects of one class.
#[derive(Clone, Debug)]
pub(crate) struct Slab {
    /// The arena slot of the slab's chunk allocation.
    pub alloc_slot: u32,
    pub class: u16,
    /// The tag of every object in it (and of its chunk allocation).
    pub tag: u32,
    /// Small-table slot of the allocation at each index.
    pub members: Vec<Option<u32>>,
    free: Vec<u32>,
    /// Objects taken: live ones and retired ones.
    pub used: u32,
    /// Of `used`, the retired ones (old places of copy-resized objects).
    pub retired: u32,
    pub pinned: u32,
}

/// Where a small id's bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SmallEntry {
    /// In a slab, at an index.
    InSlab { slab: u32, index: u32, size: u64, pinned: bool },
    /// Resized beyond the small classes: now a whole-chunk allocation in
    /// this arena slot (the id stays the same).
    Promoted { alloc_slot: u32 },
}

#[derive(Clone, Debug)]
pub(crate) struct SmallSlot {
    pub generation: u32,
    pub entry: Option<SmallEntry>,
}

/// All slabs and small allocations of an arena.
#[derive(Clone, Debug)]
pub(crate) struct SmallTable {
    pub classes: SizeClasses,
    pub slots: Vec<SmallSlot>,
    free_slots: Vec<u32>,
    pub slabs: Vec<Option<Slab>>,
    free_slabs: Vec<u32>,
    /// Slabs with a free object, per tag and class.
    partial: BTreeMap<(u32, u16), BTreeSet<u32>>,
    /// Live small allocations in slabs, and their requested bytes.
    pub live: u64,
    pub live_bytes: u64,
    /// Old places of objects moved by a copy-resize: (slab, index). They
    /// stay reserved, like a retired range, until retired memory is released.
    retired: Vec<(u32, u32)>,
    pub retired_bytes: u64,
}

impl SmallTable {
    pub fn new(chunk: u64) -> SmallTable {
        SmallTable {
            classes: SizeClasses::new(chunk),
            slots: Vec::new(),
            free_slots: Vec::new(),
            slabs: Vec::new(),
            free_slabs: Vec::new(),
            partial: BTreeMap::new(),
            live: 0,
            live_bytes: 0,
            retired: Vec::new(),
            retired_bytes: 0,
        }
    }

    /// The slabs of `tag` and `class` with a free object, lowest first.
    pub fn partial_slabs(&self, tag: u32, class: u16) -> impl Iterator<Item = u32> + '_ {
        self.partial.get(&(tag, class)).into_iter().flatten().copied()
    }

    fn partial_mut(&mut self, tag: u32, class: u16) -> &mut BTreeSet<u32> {
        self.partial.entry((tag, class)).or_default()
    }

    fn not_partial(&mut self, tag: u32, class: u16, slab: u32) {
        if let Some(set) = self.partial.get_mut(&(tag, class)) {
            set.remove(&slab);
            if set.is_empty() {
                self.partial.remove(&(tag, class));
            }
        }
    }

    /// Registers a new, empty slab of `tag` over the arena allocation `alloc_slot`.
    pub fn add_slab(&mut self, tag: u32, class: u16, alloc_slot: u32) -> u32 {
        let n = self.classes.per_slab(class);
        let slab = Slab {
            alloc_slot,
            class,
            tag,
            members: vec![None; n as usize],
            free: (0..n).rev().collect(),
            used: 0,
            retired: 0,
            pinned: 0,
        };
        let idx = match self.free_slabs.pop() {
            Some(i) => {
                self.slabs[i as usize] = Some(slab);
                i
            }
            None => {
                self.slabs.push(Some(slab));
                (self.slabs.len() - 1) as u32
            }
        };
        self.partial_mut(tag, class).insert(idx);
        idx
    }

    pub fn slab(&self, idx: u32) -> &Slab {
        self.slabs[idx as usize].as_ref().expect("live slab")
    }

    fn slab_mut(&mut self, idx: u32) -> &mut Slab {
        self.slabs[idx as usize].as_mut().expect("live slab")
    }

    fn new_slot(&mut self, entry: SmallEntry) -> u32 {
        match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize].entry = Some(entry);
                s
            }
            None => {
                self.slots.push(SmallSlot { generation: 1, entry: Some(entry) });
                (self.slots.len() - 1) as u32
            }
        }
    }

    /// Takes an object of `slab` for a new allocation of `size` bytes;
    /// returns (small slot, index).
    pub fn take(&mut self, slab: u32, size: u64) -> (u32, u32) {
        let index = self.slab_mut(slab).free.pop().expect("partial slab has a free object");
        let slot = self.new_slot(SmallEntry::InSlab { slab, index, size, pinned: false });
        let s = self.slab_mut(slab);
        s.members[index as usize] = Some(slot);
        s.used += 1;
        let (tag, class, full) = (s.tag, s.class, s.free.is_empty());
        if full {
            self.not_partial(tag, class, slab);
        }
        self.live += 1;
        self.live_bytes += size;
        (slot, index)
    }

    /// Gives an object back. Returns the slab's arena slot if the slab is
    /// now empty and was dropped (the caller frees that allocation).
    pub fn give_back(&mut self, slab: u32, index: u32, size: u64) -> Option<u32> {
        self.live -= 1;
        self.live_bytes -= size;
        self.free_object(slab, index)
    }

    /// Returns an object to its slab's free list (no live accounting).
    fn free_object(&mut self, slab: u32, index: u32) -> Option<u32> {
        let s = self.slab_mut(slab);
        s.members[index as usize] = None;
        s.free.push(index);
        s.used -= 1;
        let (tag, class, used, alloc_slot) = (s.tag, s.class, s.used, s.alloc_slot);
        if used == 0 {
            self.not_partial(tag, class, slab);
            self.slabs[slab as usize] = None;
            self.free_slabs.push(slab);
            return Some(alloc_slot);
        }
        self.partial_mut(tag, class).insert(slab);
        None
    }

    /// The entry of a live small slot.
    pub fn entry_of(&self, slot: u32) -> &SmallEntry {
        self.slots[slot as usize].entry.as_ref().expect("live small slot")
    }

    /// The slab of a small allocation in a slab, `None` for a promoted one.
    pub fn slab_of(&self, slot: u32) -> Option<&Slab> {
        match self.entry_of(slot) {
            SmallEntry::InSlab { slab, .. } => Some(self.slab(*slab)),
            SmallEntry::Promoted { .. } => None,
        }
    }

    /// Requested size of a small allocation (in a slab).
    pub fn size_of(&self, slot: u32) -> u64 {
        match self.entry_of(slot) {
            SmallEntry::InSlab { size, .. } => *size,
            SmallEntry::Promoted { .. } => 0,
        }
    }

    /// Slabs in use.
    pub fn slab_count(&self) -> u64 {
        (self.slabs.len() - self.free_slabs.len()) as u64
    }

    /// Gives back the object of small slot `slot` (unpinning it first); the
    /// slot itself stays. Returns the arena slot of the slab if it is now
    /// empty and was dropped.
    pub fn release(&mut self, slot: u32) -> Option<u32> {
        let SmallEntry::InSlab { slab, index, size, pinned } = *self.entry_of(slot) else {
            return None;
        };
        if pinned {
            self.set_pinned(slot, false);
        }
        self.give_back(slab, index, size)
    }

    /// Keeps the object of small slot `slot` taken while no id names it
    /// (a free ordered on a stream whose event is not complete): it stops
    /// counting as live and is unpinned; the slot itself stays for the
    /// caller to drop. Returns where the object is, for [`SmallTable::free_held`].
    pub fn hold(&mut self, slot: u32) -> Option<(u32, u32)> {
        let SmallEntry::InSlab { slab, index, size, pinned } = *self.entry_of(slot) else {
            return None;
        };
        if pinned {
            self.set_pinned(slot, false);
        }
        self.slab_mut(slab).members[index as usize] = None;
        self.live -= 1;
        self.live_bytes -= size;
        Some((slab, index))
    }

    /// Gives back an object kept by [`SmallTable::hold`]. Returns the
    /// slab's arena slot if the slab is now empty and was dropped.
    pub fn free_held(&mut self, slab: u32, index: u32) -> Option<u32> {
        self.free_object(slab, index)
    }

    /// Retires the object of small slot `slot` (the slot itself stays): its
    /// old address keeps its bytes until [`SmallTable::release_retired`].
    pub fn retire(&mut self, slot: u32) {
        let SmallEntry::InSlab { slab, index, size, pinned } = *self.entry_of(slot) else {
            return;
        };
        debug_assert!(!pinned, "a pinned object never moves");
        let class = self.slab(slab).class;
        let s = self.slab_mut(slab);
        s.members[index as usize] = None;
        s.retired += 1;
        self.retired.push((slab, index));
        self.retired_bytes += self.classes.size(class);
        self.live -= 1;
        self.live_bytes -= size;
    }

    /// Slabs holding only retired objects: releasing retired memory gives
    /// their chunks back to the pool.
    /// They back no live allocation (the stats count them as pooled).
    pub fn reclaimable_slabs(&self) -> u64 {
        if self.retired.is_empty() {
            return 0;
        }
        self.slabs.iter().flatten().filter(|s| s.used == s.retired).count() as u64
    }

    /// Frees the retired objects of up to `n` slabs that hold nothing else
    /// (lowest slab numbers first); every other retired object stays.
    /// Returns the arena slots of those slabs, now empty (the caller frees
    /// those allocations).
    pub fn release_idle_slabs(&mut self, n: u64) -> Vec<u32> {
        let idle: Vec<u32> = (0..self.slabs.len() as u32)
            .filter(|&i| self.slabs[i as usize].as_ref().is_some_and(|s| s.used > 0 && s.used == s.retired))
            .take(n as usize)
            .collect();
        let (mine, rest): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.retired).into_iter().partition(|(slab, _)| idle.contains(slab));
        self.retired = rest;
        mine.into_iter()
            .filter_map(|(slab, index)| {
                self.retired_bytes -= self.classes.size(self.slab(slab).class);
                self.slab_mut(slab).retired -= 1;
                self.free_object(slab, index)
            })
            .collect()
    }

    /// Whether no object is retired.
    pub fn nothing_retired(&self) -> bool {
        self.retired.is_empty()
    }

    /// Frees every retired object; returns the arena slots of slabs that
    /// became empty (the caller frees those allocations).
    pub fn release_retired(&mut self) -> Vec<u32> {
        let retired = std::mem::take(&mut self.retired);
        self.retired_bytes = 0;
        retired
            .into_iter()
            .filter_map(|(slab, index)| {
                self.slab_mut(slab).retired -= 1;
                self.free_object(slab, index)
            })
            .collect()
    }

    /// Moves the object of `tmp` (a fresh slot) under the identity of `slot`
    /// and forgets `tmp`.
    pub fn adopt(&mut self, slot: u32, tmp: u32) {
        let entry = self.slots[tmp as usize].entry.take().expect("live tmp slot");
        if let SmallEntry::InSlab { slab, index, .. } = entry {
            self.slab_mut(slab).members[index as usize] = Some(slot);
        }
        self.slots[slot as usize].entry = Some(entry);
        self.drop_slot(tmp);
    }

    /// Frees a small slot's id (bumps the generation; retires a wrapping slot).
    pub fn drop_slot(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        s.entry = None;
        if s.generation < crate::id::MAX_GENERATION {
            s.generation += 1;
            self.free_slots.push(slot);
        }
    }

    pub fn set_entry(&mut self, slot: u32, entry: SmallEntry) {
        self.slots[slot as usize].entry = Some(entry);
    }

    pub fn entry(&self, slot: u32, generation: u32) -> Option<&SmallEntry> {
        match self.slots.get(slot as usize) {
            Some(s) if s.generation == generation => s.entry.as_ref(),
            _ => None,
        }
    }

    /// Pins or unpins one object; returns the slab's new pinned count.
    pub fn set_pinned(&mut self, slot: u32, pinned: bool) -> Option<(u32, u32)> {
        let Some(SmallEntry::InSlab { slab, pinned: p, .. }) = self.slots[slot as usize].entry.as_mut() else {
            return None;
        };
        let slab = *slab;
        let changed = *p != pinned;
        *p = pinned;
        let s = self.slab_mut(slab);
        if changed {
            if pinned {
                s.pinned += 1;
            } else {
                s.pinned -= 1;
            }
        }
        Some((s.alloc_slot, s.pinned))
    }

    /// Updates the requested size of an object (resize within its class).
    pub fn set_size(&mut self, slot: u32, new_size: u64) {
        if let Some(SmallEntry::InSlab { size, .. }) = self.slots[slot as usize].entry.as_mut() {
            self.live_bytes = self.live_bytes - *size + new_size;
            *size = new_size;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: u64 = 2 << 20;

    #[test]
    fn classes_are_aligned_increasing_and_bounded_in_waste() {
        let c = SizeClasses::new(C);
        assert_eq!(c.threshold(), 1 << 20);
        let mut prev = 0;
        for i in 0..c.count() as u16 {
            let s = c.size(i);
            assert!(s > prev && s % SMALL_ALIGN == 0, "{s}");
            prev = s;
        }
        // Worst case per object: just above a class boundary.
        // Below 1 KiB the 256-byte alignment dominates: waste under 256 bytes.
        for size in [1u64, 255, 257, 513, 1000] {
            let s = c.size(c.class_of(size).unwrap());
            assert!(s >= size && s - size < SMALL_ALIGN, "{size} -> {s}");
        }
        for size in [1025u64, 4097, 65537, 262145, 300_000, 700_000, 1 << 20] {
            let s = c.size(c.class_of(size).unwrap());
            assert!(s >= size);
            assert!((s - size) as f64 / s as f64 <= 0.34, "{size} -> {s}");
        }
        assert_eq!(c.class_of((1 << 20) + 1), None);
        assert_eq!(c.class_of(0), None);
        assert_eq!(c.size(c.class_of(1).unwrap()), 256);
        // Large classes fill the chunk up to less than one alignment unit per object.
        for i in 0..c.count() as u16 {
            let n = c.per_slab(i) as u64;
            if c.size(i) > C / 8 {
                assert!(C - n * c.size(i) < SMALL_ALIGN * n, "class {}", c.size(i));
            }
        }
    }

    #[test]
    fn slabs_fill_and_empty() {
        let mut t = SmallTable::new(C);
        let cls = t.classes.class_of(1 << 20).unwrap();
        assert_eq!(t.classes.per_slab(cls), 2);
        let slab = t.add_slab(0, cls, 7);
        let (a, ia) = t.take(slab, 1 << 20);
        let (b, ib) = t.take(slab, 1000);
        assert_ne!(ia, ib);
        assert_eq!(t.partial_slabs(0, cls).next(), None, "full");
        assert_eq!(t.give_back(slab, ia, 1 << 20), None);
        t.drop_slot(a);
        assert_eq!(t.partial_slabs(0, cls).next(), Some(slab));
        assert_eq!(t.partial_slabs(1, cls).next(), None, "another tag's slab");
        assert_eq!(t.give_back(slab, ib, 1000), Some(7), "empty slab is dropped");
        t.drop_slot(b);
        assert_eq!((t.live, t.live_bytes), (0, 0));
    }
}
