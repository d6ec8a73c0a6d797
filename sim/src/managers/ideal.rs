//! Policies without an allocator (`ideal-contiguous`, `contiguous-max`):
//! they separate the policy's cost from the allocator's.

use super::*;

/// Contiguous KV with no allocator at all: physical memory is exactly the
/// sum of the tensors, and an admission or growth fails only when that sum
/// would pass the capacity. Two policies:
/// - `ideal-contiguous`: the PyTorch rows' growth policy (room for the next
///   power of two of tokens, at least 16, doubling with a copy of the
///   stored KV when full), so the gap between it and the PyTorch rows is
///   the allocator's;
/// - `contiguous-max`: room for prompt + `max_tokens` at admission (more if
///   a preempted request comes back longer), never grown, never copied.
///
/// Tags live in host vectors (there is no device memory to write through).
pub struct IdealMgr {
    name: &'static str,
    shape: KvShape,
    capacity: u64,
    /// `Some(n)`: contiguous-max with `n` output tokens of room.
    max_tokens: Option<u64>,
    /// Per sequence: token capacity of its tensors, and its tags.
    seqs: Vec<Option<(u64, Vec<u64>)>>,
    held: u64,
    peak: u64,
    copied: u64,
}

impl IdealMgr {
    pub fn new(name: &'static str, shape: KvShape, capacity: u64, max_tokens: Option<u64>) -> IdealMgr {
        IdealMgr { name, shape, capacity, max_tokens, seqs: Vec::new(), held: 0, peak: 0, copied: 0 }
    }

    /// Bytes of all of a request's tensors with room for `tokens`.
    fn bytes(&self, tokens: u64) -> u64 {
        tokens * self.shape.bpt() * self.shape.n_allocs()
    }

    fn hold(&mut self, more: u64) -> Result<(), Fail> {
        if self.held + more > self.capacity {
            return Err(Fail {
                fragmentation: false,
                host_limit: false,
                message: format!("{more} more bytes needed, {} of {} held", self.held, self.capacity),
            });
        }
        self.held += more;
        self.peak = self.peak.max(self.held);
        Ok(())
    }
}

impl KvManager for IdealMgr {
    fn name(&self) -> &'static str {
        self.name
    }

    fn admit(&mut self, seq: usize, tokens: u64, q: &Request) -> Result<u64, Fail> {
        let cap = match self.max_tokens {
            Some(m) => tokens.max(q.prompt + m),
            None => pow2_tokens(tokens),
        };
        self.hold(self.bytes(cap))?;
        *slot_vec(&mut self.seqs, seq) = Some((cap, Vec::with_capacity(tokens as usize)));
        Ok(0)
    }

    fn grow(&mut self, seq: usize, tokens: u64, stored: u64) -> Result<(), Fail> {
        let cap = self.seqs[seq].as_ref().expect("live").0;
        if tokens <= cap {
            return Ok(());
        }
        if self.max_tokens.is_some() {
            return Err(Fail {
                fragmentation: false,
                host_limit: false,
                message: format!("contiguous-max never grows: {tokens} tokens > room for {cap}"),
            });
        }
        let mut new_cap = cap * 2;
        while new_cap < tokens {
            new_cap *= 2;
        }
        // Old and new tensors coexist during the copy.
        self.hold(self.bytes(new_cap))?;
        self.held -= self.bytes(cap);
        self.copied += stored * self.shape.kv_bytes_per_token;
        self.seqs[seq].as_mut().expect("live").0 = new_cap;
        Ok(())
    }

    fn free(&mut self, seq: usize) {
        if let Some((cap, _)) = self.seqs[seq].take() {
            self.held -= self.bytes(cap);
        }
    }

    fn write_tag(&mut self, seq: usize, t: u64, tag: u64) -> bool {
        let Some((cap, tags)) = self.seqs[seq].as_mut() else { return false };
        if t >= *cap {
            return false;
        }
        if tags.len() <= t as usize {
            tags.resize(t as usize + 1, 0);
        }
        tags[t as usize] = tag;
        true
    }

    fn read_tag(&mut self, seq: usize, t: u64) -> Option<u64> {
        self.seqs[seq].as_ref()?.1.get(t as usize).copied()
    }

    fn physical_bytes(&self) -> u64 {
        self.held
    }

    fn peak_physical_bytes(&self) -> u64 {
        self.peak
    }

    fn calls(&self) -> Calls {
        Calls::default()
    }

    fn bytes_copied(&self) -> u64 {
        self.copied
    }

    fn moves(&self) -> u64 {
        0
    }
}
