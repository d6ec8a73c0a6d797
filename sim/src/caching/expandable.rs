//! Expandable segments (`expandable_segments:True`): one segment per pool
//! over a large reservation, mapped and unmapped a page at a time
//! (`find_expandable_block`, `map_block`, `unmap_block`,
//! `ExpandableSegment::map/unmap`; see the module above for the model).

use super::*;

impl<D: Driver> CachingAllocator<D> {
    fn find_expandable_block(&mut self, pool: usize, size: u64) -> Result<Idx, Error> {
        let allocatable = |s: &Self, i: Option<Idx>| i.is_some_and(|i| !s.b(i).allocated);
        let has_room = |s: &Self, mut i: Option<Idx>| {
            let mut bytes = 0;
            while bytes < size && allocatable(s, i) {
                let b = s.b(i.expect("checked"));
                bytes += b.size;
                i = b.next;
            }
            bytes >= size
        };
        for &(_, u) in &self.pools[pool].unmapped {
            let mut c = u;
            if allocatable(self, self.b(u).prev) {
                c = self.b(u).prev.expect("checked");
            }
            if has_room(self, Some(c)) {
                return Ok(c);
            }
        }
        let page = if pool == SMALL { K_SMALL_BUFFER } else { K_LARGE_BUFFER };
        let va = self.capacity + self.capacity / 8;
        let max_handles = va.div_ceil(page).max(1);
        let base = self.drv.reserve(max_handles * page, K_ROUND_LARGE)?;
        self.exp.push(Some(ExpSeg { rank: self.next_rank, base, page, max_handles, handles: Vec::new() }));
        self.next_rank += 1;
        let si = self.exp.len() - 1;
        let c = self.new_block(Block {
            ptr: base,
            size: max_handles * page,
            requested: 0,
            pool,
            allocated: false,
            mapped: false,
            prev: None,
            next: None,
            seg: si,
        });
        self.insert_unmapped(c);
        Ok(c)
    }

    /// `ExpandableSegment::map`: creates and maps the pages covering
    /// `ptr..ptr+size`; returns the mapped size (0: out of memory).
    fn seg_map(&mut self, si: usize, ptr: u64, size: u64) -> Result<u64, Error> {
        let seg = self.exp[si].as_mut().expect("live segment");
        let begin = (ptr - seg.base) / seg.page;
        let end = (ptr + size - seg.base).div_ceil(seg.page);
        debug_assert_eq!(seg.base + begin * seg.page, ptr);
        debug_assert!(end <= seg.max_handles);
        if begin == end {
            return Ok(0);
        }
        while (seg.handles.len() as u64) < end {
            seg.handles.push(None);
        }
        let page = seg.page;
        for i in begin..end {
            match self.drv.create(page) {
                Ok(h) => self.exp[si].as_mut().expect("live").handles[i as usize] = Some(h),
                Err(e) => {
                    let seg = self.exp[si].as_mut().expect("live");
                    for j in begin..i {
                        if let Some(h) = seg.handles[j as usize].take() {
                            let _ = self.drv.release(h);
                        }
                    }
                    while seg.handles.last().is_some_and(|h| h.is_none()) {
                        seg.handles.pop();
                    }
                    return Err(e);
                }
            }
        }
        let seg = self.exp[si].as_ref().expect("live");
        for i in begin..end {
            let h = seg.handles[i as usize].expect("just created");
            self.drv.map(seg.base + i * page, page, h, 0)?;
        }
        self.drv.set_access(seg.base + begin * page, (end - begin) * page)?;
        Ok((end - begin) * page)
    }

    fn map_block(&mut self, to_map: Idx, size: u64) -> Result<(), Error> {
        let (ptr, si) = (self.b(to_map).ptr, self.b(to_map).seg);
        let mapped = self.seg_map(si, ptr, size)?;
        if mapped == 0 {
            return Err(Error::OutOfMemory("empty map".into()));
        }
        self.remove_unmapped(to_map);
        self.bm(to_map).mapped = true;
        let b = self.b(to_map).clone();
        if mapped < b.size {
            let rem = self.new_block(Block {
                ptr: b.ptr + mapped,
                size: b.size - mapped,
                requested: 0,
                pool: b.pool,
                allocated: false,
                mapped: false,
                prev: Some(to_map),
                next: b.next,
                seg: b.seg,
            });
            if let Some(n) = b.next {
                self.bm(n).prev = Some(rem);
            }
            self.bm(to_map).next = Some(rem);
            self.bm(to_map).size = mapped;
            self.insert_unmapped(rem);
        }
        let prev = self.b(to_map).prev;
        self.try_merge_blocks(to_map, prev);
        let next = self.b(to_map).next;
        self.try_merge_blocks(to_map, next);
        self.insert_free(to_map);
        self.stats.reserved_bytes += mapped;
        self.stats.peak_reserved_bytes = self.stats.peak_reserved_bytes.max(self.stats.reserved_bytes);
        self.stats.num_device_alloc += 1;
        Ok(())
    }

    pub(super) fn try_allocate_expandable_block(&mut self, pool: usize, size: u64) -> Result<Idx, Error> {
        let mut c = self.find_expandable_block(pool, size)?;
        if !self.b(c).mapped {
            let s = self.b(c).size.min(size);
            self.map_block(c, s)?;
        }
        while self.b(c).size < size {
            let remaining = size - self.b(c).size;
            let n = self.b(c).next.expect("room was checked");
            let s = remaining.min(self.b(n).size);
            self.map_block(n, s)?;
            c = n;
        }
        self.remove_free(c);
        Ok(c)
    }

    /// `unmap_block`: unmaps and releases the whole pages inside free block `i`.
    pub(super) fn unmap_block(&mut self, i: Idx) {
        let b = self.b(i).clone();
        let seg = self.exp[b.seg].as_ref().expect("live segment");
        let (base, page) = (seg.base, seg.page);
        let begin = (b.ptr - base).div_ceil(page);
        let end = (b.ptr + b.size - base) / page;
        if begin >= end {
            return;
        }
        let _ = self.drv.synchronize();
        for p in begin..end {
            let h = self.exp[b.seg].as_mut().expect("live").handles[p as usize].take().expect("mapped page");
            let _ = self.drv.unmap(base + p * page, page);
            let _ = self.drv.release(h);
        }
        let seg = self.exp[b.seg].as_mut().expect("live");
        while seg.handles.last().is_some_and(|h| h.is_none()) {
            seg.handles.pop();
        }
        self.remove_free(i);
        let un_ptr = base + begin * page;
        let un_size = (end - begin) * page;
        let before = un_ptr - b.ptr;
        if before > 0 {
            let bf = self.new_block(Block {
                ptr: b.ptr,
                size: before,
                requested: 0,
                pool: b.pool,
                allocated: false,
                mapped: true,
                prev: b.prev,
                next: Some(i),
                seg: b.seg,
            });
            if let Some(p) = b.prev {
                self.bm(p).next = Some(bf);
            }
            self.bm(i).prev = Some(bf);
            self.insert_free(bf);
        }
        let after = b.size - before - un_size;
        if after > 0 {
            let next = self.b(i).next;
            let af = self.new_block(Block {
                ptr: un_ptr + un_size,
                size: after,
                requested: 0,
                pool: b.pool,
                allocated: false,
                mapped: true,
                prev: Some(i),
                next,
                seg: b.seg,
            });
            if let Some(n) = next {
                self.bm(n).prev = Some(af);
            }
            self.bm(i).next = Some(af);
            self.insert_free(af);
        }
        {
            let m = self.bm(i);
            m.ptr = un_ptr;
            m.size = un_size;
            m.mapped = false;
        }
        let prev = self.b(i).prev;
        self.try_merge_blocks(i, prev);
        let next = self.b(i).next;
        self.try_merge_blocks(i, next);
        self.insert_unmapped(i);
        self.stats.reserved_bytes -= un_size;
        self.stats.num_device_free += 1;
    }

    pub(super) fn release_expandable_segment(&mut self, i: Idx) {
        self.remove_unmapped(i);
        let b = self.b(i).clone();
        let seg = self.exp[b.seg].take().expect("live segment");
        debug_assert_eq!(b.size, seg.max_handles * seg.page);
        debug_assert!(!b.mapped);
        let _ = self.drv.free_reservation(seg.base, seg.max_handles * seg.page);
        self.delete_block(i);
    }
}
