//! Contiguous KV on PyTorch's caching allocator (native and expandable
//! segments): each request's tensor doubles with a copy when full.

use super::*;

/// A request's KV as contiguous tensors from PyTorch's caching allocator
/// (native or expandable segments). A contiguous cache without virtual
/// memory must grow by reallocation: each tensor starts with room for the
/// next power of two of tokens (at least 16) and doubles when full,
/// copying its stored KV into the new tensor (`driver.copy` of every stored
/// tag; `bytes_copied` counts the stored KV bytes a GPU would copy).
pub struct TorchMgr {
    name: &'static str,
    alloc: CachingAllocator<Dev>,
    dev: Dev,
    shape: KvShape,
    seqs: Vec<Option<Vec<(u64, u64)>>>,
    copied: u64,
    copy_errors: u64,
    capacity: u64,
    discard: bool,
}

pub(super) fn pow2_tokens(tokens: u64) -> u64 {
    tokens.max(16).next_power_of_two()
}

impl TorchMgr {
    pub fn new(name: &'static str, shape: KvShape, capacity: u64, expandable: bool) -> Result<TorchMgr, String> {
        let dev = new_device(capacity)?;
        Ok(TorchMgr {
            name,
            alloc: CachingAllocator::new(dev.clone(), capacity, expandable),
            dev,
            shape,
            seqs: Vec::new(),
            copied: 0,
            copy_errors: 0,
            capacity,
            discard: false,
        })
    }

    /// The device (for managers made of several, `tp.rs`).
    pub fn device(&self) -> &Dev {
        &self.dev
    }

    /// The caching allocator, for tensors sharing it with the KV
    /// (activations, in `tp.rs`).
    pub fn allocator_mut(&mut self) -> &mut CachingAllocator<Dev> {
        &mut self.alloc
    }

    /// `remaining`: bytes the operation still had to allocate when it failed.
    fn fail(oom: super::super::caching::Oom, remaining: u64) -> Fail {
        let free = oom.capacity.saturating_sub(oom.allocated_bytes);
        Fail {
            fragmentation: oom.driver_error.is_none() && free >= remaining.max(oom.size),
            host_limit: oom.driver_error.is_some(),
            message: format!(
                "out of memory: tried {} bytes; {} in use, {} reserved, largest free block {}{}",
                oom.size,
                oom.allocated_bytes,
                oom.reserved_bytes,
                oom.largest_free_block,
                oom.driver_error.map(|e| format!(" (driver: {e})")).unwrap_or_default()
            ),
        }
    }
}

impl KvManager for TorchMgr {
    fn name(&self) -> &'static str {
        self.name
    }

    fn admit(&mut self, seq: usize, tokens: u64, _q: &Request) -> Result<u64, Fail> {
        let cap = pow2_tokens(tokens);
        let n = self.shape.n_allocs() as usize;
        let mut v = Vec::with_capacity(n);
        for k in 0..n {
            match self.alloc.malloc(cap * self.shape.bpt()) {
                Ok(p) => v.push((p, cap)),
                Err(oom) => {
                    let remaining = (n - k) as u64 * oom.size;
                    for (p, _) in v {
                        self.alloc.free(p);
                    }
                    return Err(Self::fail(oom, remaining));
                }
            }
        }
        *slot_vec(&mut self.seqs, seq) = Some(v);
        Ok(0)
    }

    fn grow(&mut self, seq: usize, tokens: u64, stored: u64) -> Result<(), Fail> {
        let n = self.shape.n_allocs();
        let bpt = self.shape.bpt();
        for a in 0..n as usize {
            let (old, cap) = self.seqs[seq].as_ref().expect("live")[a];
            if tokens <= cap {
                continue;
            }
            let mut new_cap = cap * 2;
            while new_cap < tokens {
                new_cap *= 2;
            }
            let new = self.alloc.malloc(new_cap * bpt).map_err(|oom| {
                let remaining = (n - a as u64) * oom.size;
                Self::fail(oom, remaining)
            })?;
            // Copy the stored KV: the tags are what this simulation stores.
            let mut t = a as u64;
            while t < stored {
                if self.dev.copy(new + t * bpt, old + t * bpt, 8).is_err() {
                    self.copy_errors += 1;
                }
                t += n;
            }
            self.copied += stored * bpt;
            if self.discard {
                discard(old, cap * bpt);
            }
            self.alloc.free(old);
            self.seqs[seq].as_mut().expect("live")[a] = (new, new_cap);
        }
        Ok(())
    }

    fn free(&mut self, seq: usize) {
        if let Some(v) = self.seqs[seq].take() {
            for (p, cap) in v {
                if self.discard {
                    discard(p, cap * self.shape.bpt());
                }
                self.alloc.free(p);
            }
        }
    }

    fn write_tag(&mut self, seq: usize, t: u64, tag: u64) -> bool {
        let (a, off) = self.shape.slot(t);
        let p = self.seqs[seq].as_ref().expect("live")[a].0;
        self.dev.write(p + off, &tag.to_le_bytes()).is_ok()
    }

    fn read_tag(&mut self, seq: usize, t: u64) -> Option<u64> {
        let (a, off) = self.shape.slot(t);
        let p = self.seqs[seq].as_ref().expect("live")[a].0;
        let mut b = [0u8; 8];
        self.dev.read(p + off, &mut b).ok()?;
        Some(u64::from_le_bytes(b))
    }

    fn counting_device(&self) -> Option<&Dev> {
        Some(&self.dev)
    }

    fn bytes_copied(&self) -> u64 {
        self.copied
    }

    fn housekeeping(&mut self) {
        self.discard = self.dev.inner().allocated_file_bytes().unwrap_or(0) > host_budget(self.capacity);
    }

    fn gpu_finished_step(&mut self) {
        self.dev.finish_gpu_step();
    }

    fn moves(&self) -> u64 {
        0
    }

    fn extra(&self) -> Vec<(String, String)> {
        let s = self.alloc.stats();
        vec![
            ("num_alloc_retries".into(), s.num_alloc_retries.to_string()),
            ("num_ooms".into(), s.num_ooms.to_string()),
            ("segment_allocs".into(), s.num_device_alloc.to_string()),
            ("segment_frees".into(), s.num_device_free.to_string()),
            ("peak_reserved_bytes".into(), s.peak_reserved_bytes.to_string()),
            ("copy_errors".into(), self.copy_errors.to_string()),
        ]
    }
}
