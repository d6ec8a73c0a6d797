//! A model of the CUDA virtual-memory rules, shared by the host and mock
//! backends so that both reject exactly what a real GPU driver would reject.
//!
//! It tracks reservations, chunks and mappings, and answers "may this call
//! happen?" before a backend performs it. Pure bookkeeping: no system calls.

use std::collections::BTreeMap;

use crate::driver::ChunkHandle;
use crate::error::{Error, Result};

#[derive(Clone, Debug)]
struct Mapping {
    size: u64,
    chunk: ChunkHandle,
    offset: u64,
    accessible: bool,
}

#[derive(Clone, Debug)]
struct Chunk {
    size: u64,
    /// Released by the caller; memory lives until `mappings` drops to zero.
    released: bool,
    mappings: u64,
    /// Imported read-only: mappings of it are readable, never writable.
    read_only: bool,
}

/// What a backend must do after an unmap: chunks whose memory is now gone.
#[derive(Debug, Default)]
pub(crate) struct Unmapped {
    pub freed_chunks: Vec<(ChunkHandle, u64)>,
}

/// The mapping and chunk tables of one backend instance.
#[derive(Debug, Default)]
pub(crate) struct Rules {
    granularity: u64,
    reservations: BTreeMap<u64, u64>,
    chunks: BTreeMap<ChunkHandle, Chunk>,
    mappings: BTreeMap<u64, Mapping>,
    /// Refuse an unmap that spans several separate mappings (the strict
    /// reading of `cuMemUnmap`, see `arena/unmap.rs`).
    strict_unmap: bool,
}

fn rule(call: &'static str, message: String) -> Error {
    Error::Driver { call, code: 1, name: "INVALID_VALUE".into(), message }
}

impl Rules {
    pub fn new(granularity: u64) -> Rules {
        Rules { granularity, ..Rules::default() }
    }

    fn aligned(&self, call: &'static str, what: &str, v: u64) -> Result<()> {
        if v % self.granularity != 0 {
            return Err(rule(call, format!("{what} {v:#x} is not a multiple of {:#x}", self.granularity)));
        }
        Ok(())
    }

    pub fn live_chunks(&self) -> usize {
        self.chunks.values().filter(|c| !c.released).count()
    }

    pub fn live_mappings(&self) -> usize {
        self.mappings.len()
    }

    /// Chunks released while still mapped: their memory lives until the
    /// last unmap (allowed by `cuMemRelease`, but the arena never means
    /// to: a chunk it gives back is unmapped everywhere first).
    pub fn released_but_mapped(&self) -> usize {
        self.chunks.values().filter(|c| c.released).count()
    }

    /// `cuMemAddressReserve` takes an alignment of 0 (the default) or a power
    /// of two and refuses anything else; checking it here lets host and mock
    /// runs catch a caller that would only fail on a GPU.
    pub fn check_reserve(&self, size: u64, align: u64) -> Result<()> {
        if size == 0 {
            return Err(Error::invalid("reserve: zero-sized reservation"));
        }
        if align != 0 && !align.is_power_of_two() {
            return Err(Error::invalid(format!(
                "reserve: alignment {align:#x} is not a power of two (cuMemAddressReserve refuses it)"
            )));
        }
        Ok(())
    }

    pub fn live_reservations(&self) -> usize {
        self.reservations.len()
    }

    pub fn add_reservation(&mut self, base: u64, size: u64) {
        self.reservations.insert(base, size);
    }

    pub fn check_free_reservation(&self, base: u64, size: u64) -> Result<()> {
        match self.reservations.get(&base) {
            Some(&s) if s == size => {}
            _ => return Err(rule("free_reservation", format!("no reservation of {size:#x} at {base:#x}"))),
        }
        if self.mappings.range(base..base + size).next().is_some() {
            return Err(rule("free_reservation", "reservation still has mappings".into()));
        }
        Ok(())
    }

    pub fn remove_reservation(&mut self, base: u64) {
        self.reservations.remove(&base);
    }

    pub fn check_create(&self, size: u64) -> Result<()> {
        if size == 0 {
            return Err(rule("create", "zero-sized chunk".into()));
        }
        self.aligned("create", "size", size)
    }

    pub fn add_chunk(&mut self, handle: ChunkHandle, size: u64) {
        self.chunks.insert(handle, Chunk { size, released: false, mappings: 0, read_only: false });
    }

    /// A chunk imported read-only: [`Rules::check_writable`] refuses writes to it.
    pub fn add_read_only_chunk(&mut self, handle: ChunkHandle, size: u64) {
        self.chunks.insert(handle, Chunk { size, released: false, mappings: 0, read_only: true });
    }

    /// Whether any chunk mapped in `addr..addr+size` is read-only.
    pub fn maps_read_only(&self, addr: u64, size: u64) -> bool {
        self.mappings.range(addr..addr + size).any(|(_, m)| self.chunks.get(&m.chunk).is_some_and(|c| c.read_only))
    }

    /// Refuses a write to resolved pieces of which one is read-only.
    pub fn check_writable(&self, call: &'static str, pieces: &[(ChunkHandle, u64, u64)]) -> Result<()> {
        match pieces.iter().find(|p| self.chunks.get(&p.0).is_some_and(|c| c.read_only)) {
            Some(p) => Err(rule(call, format!("chunk {:?} is mapped read-only", p.0))),
            None => Ok(()),
        }
    }

    /// Marks a chunk released; returns true when its memory is gone now
    /// (it had no mapping left).
    pub fn release(&mut self, handle: ChunkHandle) -> Result<bool> {
        match self.chunks.get_mut(&handle) {
            Some(c) if !c.released => {
                c.released = true;
                if c.mappings == 0 {
                    self.chunks.remove(&handle);
                    return Ok(true);
                }
                Ok(false)
            }
            _ => Err(rule("release", format!("chunk {handle:?} is unknown or already released"))),
        }
    }

    pub fn chunk_size(&self, handle: ChunkHandle) -> Option<u64> {
        self.chunks.get(&handle).map(|c| c.size)
    }

    fn in_reservation(&self, addr: u64, size: u64) -> bool {
        match self.reservations.range(..=addr).next_back() {
            Some((&b, &s)) => addr >= b && addr.checked_add(size).is_some_and(|e| e <= b + s),
            None => false,
        }
    }

    fn overlaps_mapping(&self, addr: u64, size: u64) -> bool {
        if let Some((&a, m)) = self.mappings.range(..addr + size).next_back() {
            return a + m.size > addr;
        }
        false
    }

    pub fn check_map(&self, addr: u64, size: u64, handle: ChunkHandle, offset: u64) -> Result<()> {
        self.aligned("map", "address", addr)?;
        self.aligned("map", "size", size)?;
        self.aligned("map", "offset", offset)?;
        if size == 0 {
            return Err(rule("map", "zero-sized mapping".into()));
        }
        if !self.in_reservation(addr, size) {
            return Err(rule("map", format!("span {addr:#x}+{size:#x} is outside every reservation")));
        }
        match self.chunks.get(&handle) {
            Some(c) if !c.released && offset.checked_add(size).is_some_and(|e| e <= c.size) => {}
            _ => return Err(rule("map", format!("chunk {handle:?} is unknown, released or too small"))),
        }
        if self.overlaps_mapping(addr, size) {
            return Err(rule("map", format!("span {addr:#x}+{size:#x} is already mapped")));
        }
        Ok(())
    }

    pub fn add_mapping(&mut self, addr: u64, size: u64, handle: ChunkHandle, offset: u64) {
        if let Some(c) = self.chunks.get_mut(&handle) {
            c.mappings += 1;
        }
        self.mappings.insert(addr, Mapping { size, chunk: handle, offset, accessible: false });
    }

    /// Checks that `addr..addr+size` is covered, without gaps, by whole mappings.
    fn check_whole(&self, call: &'static str, addr: u64, size: u64) -> Result<()> {
        self.aligned(call, "address", addr)?;
        self.aligned(call, "size", size)?;
        if size == 0 {
            return Err(rule(call, "empty span".into()));
        }
        if let Some((&a, m)) = self.mappings.range(..addr).next_back() {
            if a + m.size > addr {
                return Err(rule(call, format!("span {addr:#x} starts inside a mapping")));
            }
        }
        let mut next = addr;
        for (&a, m) in self.mappings.range(addr..addr + size) {
            if a != next {
                return Err(rule(call, format!("span has an unmapped gap at {next:#x}")));
            }
            next = a + m.size;
        }
        if next != addr + size {
            return Err(rule(call, format!("span ends at {next:#x}, not at a mapping end")));
        }
        Ok(())
    }

    pub fn check_set_access(&self, addr: u64, size: u64) -> Result<()> {
        self.check_whole("set_access", addr, size)
    }

    pub fn set_access(&mut self, addr: u64, size: u64) {
        for (_, m) in self.mappings.range_mut(addr..addr + size) {
            m.accessible = true;
        }
    }

    pub fn check_unmap(&self, addr: u64, size: u64) -> Result<()> {
        self.check_whole("unmap", addr, size)?;
        let n = self.mappings.range(addr..addr + size).count();
        if self.strict_unmap && n > 1 {
            return Err(rule("unmap", format!("span {addr:#x}+{size:#x} covers {n} separate mappings (strict unmap)")));
        }
        Ok(())
    }

    /// From now on, an unmap must cover exactly one mapping.
    pub fn set_strict_unmap(&mut self) {
        self.strict_unmap = true;
    }

    pub fn unmap(&mut self, addr: u64, size: u64) -> Unmapped {
        let keys: Vec<u64> = self.mappings.range(addr..addr + size).map(|(&a, _)| a).collect();
        let mut out = Unmapped::default();
        for a in keys {
            let m = self.mappings.remove(&a).expect("key just listed");
            if let Some(c) = self.chunks.get_mut(&m.chunk) {
                c.mappings -= 1;
                if c.released && c.mappings == 0 {
                    out.freed_chunks.push((m.chunk, c.size));
                    self.chunks.remove(&m.chunk);
                }
            }
        }
        out
    }

    /// Resolves an accessible span into (chunk, offset, len) pieces.
    pub fn resolve(&self, call: &'static str, addr: u64, len: u64) -> Result<Vec<(ChunkHandle, u64, u64)>> {
        let end = addr.checked_add(len).ok_or_else(|| rule(call, "span overflows".into()))?;
        let mut out = Vec::new();
        let mut at = addr;
        while at < end {
            let (&a, m) = self
                .mappings
                .range(..=at)
                .next_back()
                .filter(|(&a, m)| a + m.size > at)
                .ok_or_else(|| rule(call, format!("address {at:#x} is not mapped")))?;
            if !m.accessible {
                return Err(rule(call, format!("address {at:#x} is mapped without access")));
            }
            let piece = (a + m.size).min(end) - at;
            out.push((m.chunk, m.offset + (at - a), piece));
            at += piece;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 4096;

    fn setup() -> Rules {
        let mut r = Rules::new(G);
        r.add_reservation(0x10000, 16 * G);
        r.add_chunk(ChunkHandle(1), 2 * G);
        r.add_chunk(ChunkHandle(2), 2 * G);
        r
    }

    #[test]
    fn reserve_alignment_must_be_zero_or_a_power_of_two() {
        let r = Rules::new(G);
        for align in [0, 1, G, 2 << 20, 1 << 40] {
            r.check_reserve(16 * G, align).unwrap_or_else(|e| panic!("{align:#x}: {e}"));
        }
        for align in [3 * G, 6 << 20, 37 * G, u64::MAX] {
            match r.check_reserve(16 * G, align) {
                Err(Error::InvalidArgument(m)) => assert!(m.contains("power of two"), "{m}"),
                other => panic!("{align:#x}: expected InvalidArgument, got {other:?}"),
            }
        }
        assert!(matches!(r.check_reserve(0, G), Err(Error::InvalidArgument(_))), "zero size");
    }

    #[test]
    fn unmap_must_cover_whole_mappings() {
        let mut r = setup();
        r.check_map(0x10000, 2 * G, ChunkHandle(1), 0).unwrap();
        r.add_mapping(0x10000, 2 * G, ChunkHandle(1), 0);
        r.add_mapping(0x10000 + 2 * G, 2 * G, ChunkHandle(2), 0);
        assert!(r.check_unmap(0x10000, G).is_err(), "half a mapping");
        assert!(r.check_unmap(0x10000 + G, 2 * G).is_err(), "straddles");
        assert!(r.check_unmap(0x10000, 4 * G).is_ok(), "two whole mappings");
        r.set_strict_unmap();
        assert!(r.check_unmap(0x10000, 4 * G).is_err(), "two mappings, strict");
        assert!(r.check_set_access(0x10000, 6 * G).is_err(), "gap");
    }

    #[test]
    fn access_and_release_rules() {
        let mut r = setup();
        r.add_mapping(0x10000, 2 * G, ChunkHandle(1), 0);
        assert!(r.resolve("read", 0x10000, 8).is_err(), "no access yet");
        r.set_access(0x10000, 2 * G);
        assert_eq!(r.resolve("read", 0x10000 + 8, 8).unwrap(), vec![(ChunkHandle(1), 8, 8)]);
        assert!(!r.release(ChunkHandle(1)).unwrap(), "still mapped: memory lives");
        assert!(r.release(ChunkHandle(1)).is_err(), "double release");
        assert!(r.check_map(0x10000 + 4 * G, 2 * G, ChunkHandle(1), 0).is_err(), "released");
        let gone = r.unmap(0x10000, 2 * G);
        assert_eq!(gone.freed_chunks, vec![(ChunkHandle(1), 2 * G)]);
        assert_eq!(r.live_mappings(), 0);
        assert!(r.check_map(0x10000, 2 * G, ChunkHandle(2), 0).is_ok());
        assert!(r.check_map(0x0, 2 * G, ChunkHandle(2), 0).is_err(), "outside reservation");
        assert!(r.check_map(0x10000, 3 * G, ChunkHandle(2), 0).is_err(), "past chunk end");
    }
}
