//! The arena manager's prefix cache (issue 12): the KV of finished requests
//! kept as cache entries keyed by their Mooncake hash chains, and shared
//! with later requests by mapping the same physical chunks a second time
//! (`Arena::alloc_shared`), nothing copied.
//!
//! **Rules: those of the `vllm-paged` model** (`managers/vllm.rs`, `VllmMgr`), so
//! that the two compare like for like:
//! - the unit of caching is vLLM's 16-token block; a hash id (512 tokens,
//!   chained on its predecessors) caches a prefix of its 32 units;
//! - a lookup follows the request's chain of hash ids and takes whole units
//!   of its first `prompt - 1` tokens (the last prompt token is always
//!   computed), stopping at the first hash whose entry is not whole;
//! - at admission the request's units of its full hash blocks that follow
//!   its hit are cached (completing a chain cut by an eviction);
//! - a unit no running request maps joins an LRU queue when released (a
//!   request's units last first, as vLLM frees `reversed(blocks)`); a hit
//!   takes it out; eviction takes the oldest and cuts its hash's chain
//!   there (the later units of that hash go with it).
//!
//! One difference, which is the arena's to claim: vLLM's free queue also
//! cycles blocks that hold no cached KV (decode tokens, the unhashed rest
//! of prompts), so it evicts cached blocks while memory holding nothing of
//! value is still free. The arena frees such memory at once and evicts a
//! cached unit only when an allocation or a growth would otherwise fail.
//!
//! **Physical side.** Every arena allocation that maps cached units is a
//! *holder*: a running request's KV, or a finished request's KV shrunk to
//! its cached prefix (an *entry*, whose chunks the allocation keeps). A
//! holder maps a chain of units at positions `0..n` of its range. A unit is
//! one physical copy: it is mapped by its *origin* (the request that
//! computed it) and by every holder that shared it since. A new request
//! shares the units of its hit from the origin of the hit's last unit,
//! which maps the whole chain before it (a unit is only evicted after the
//! units that follow it in any chain: they were released no later, and
//! queued before it). Evicting a unit truncates every holder that maps it;
//! an entry left with nothing it originated is a duplicate of others'
//! chunks and is freed.
//!
//! The cache needs a unit to be whole chunks (16 tokens × bytes per token a
//! multiple of the chunk size; at 128 KiB per token a 2 MiB chunk is
//! exactly one unit): then a hit, in whole units, is whole chunks, nothing
//! is copied or recomputed, and evicting a unit frees exactly its chunks.
//! Where a unit is not whole chunks (the per-layer layout: 2 KiB per token
//! in each of 64 allocations, so a chunk holds 1,024 tokens, twice a hash
//! block; or 320 KiB per token) the arena's prefix cache is off, and the
//! replay says so.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// What the cache has done, for the report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Admissions that shared a cached prefix, and the units they shared.
    pub hits: u64,
    pub hit_units: u64,
    /// Units evicted (cutting their chains), and evictions of a unit that
    /// still followed an evicted one in some holder (never expected: see the
    /// module docs; counted to show it).
    pub evicted_units: u64,
    pub cascade_evictions: u64,
    /// Hits shortened because the chosen source did not map the whole chain
    /// (never expected; counted to show it).
    pub source_mismatches: u64,
    /// Units a request could not cache because an earlier hash of its chain
    /// was held by another copy (vLLM would cache them apart).
    pub uncached_after_gap: u64,
    /// Admissions that took over an entry's allocation (`take_over`), and
    /// the units they evicted beyond their need (the oldest queued, which
    /// LRU eviction would have taken next).
    pub take_overs: u64,
    pub early_evicted_units: u64,
    /// Finished requests kept as entries, and those freed as duplicates.
    pub entries_kept: u64,
    pub duplicates_freed: u64,
}

/// The longest cached prefix of a request: its units, in chain order, and
/// the holder to share them from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hit<K> {
    pub units: Vec<u32>,
    pub source: Option<K>,
}

/// What a release asks of the allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// Keep it as an entry, shrunk to this many units.
    Keep(usize),
    /// Free it: it holds no unit it originated. Its first `n` units are
    /// others' (still cached, mapped by their origins); the rest is dead.
    Free(usize),
}

#[derive(Clone, Debug)]
struct Unit<K> {
    hash: u64,
    index: u32,
    /// Position in its chain (units from the start of the prompt).
    pos: u32,
    /// Running requests mapping it.
    refs: u32,
    /// Its key in the LRU queue while queued (refs 0), else 0.
    stamp: u64,
    origin: K,
    holders: Vec<K>,
}

#[derive(Clone, Debug, Default)]
struct Holder {
    /// The units at positions 0..len of its range.
    units: Vec<u32>,
    running: bool,
    /// Units of `units` it computed itself.
    originated: u32,
    /// Stamps its hit took out of the queue at admission, restored if the
    /// admission fails (`abort`).
    taken: Vec<(u32, u64)>,
    /// Full hash blocks [`PrefixCache::cache_own`] has looked at so far
    /// (chunked prefill computes a prompt over several steps), and whether
    /// the chain was cut among them.
    scanned: usize,
    gap: bool,
}

/// The cache's books: pure logic, no memory. `K` names an allocation.
#[derive(Clone, Debug)]
pub struct PrefixCache<K> {
    unit_tokens: u64,
    per_hash: usize,
    /// Hash id -> its cached units, a prefix of the hash block's.
    cache: HashMap<u64, Vec<u32>>,
    units: Vec<Option<Unit<K>>>,
    spare: Vec<u32>,
    /// Units no running request maps, oldest first.
    lru: BTreeMap<u64, u32>,
    next_stamp: u64,
    holders: HashMap<K, Holder>,
    /// Units mapped by more than one running request, counted once per
    /// extra request.
    shared_live_units: u64,
    pub stats: CacheStats,
}

impl<K: Copy + Eq + Hash + std::fmt::Debug> PrefixCache<K> {
    /// A cache of `unit_tokens`-token units, `hash_tokens` per hash id.
    pub fn new(unit_tokens: u64, hash_tokens: u64) -> PrefixCache<K> {
        assert!(unit_tokens > 0 && hash_tokens % unit_tokens == 0);
        PrefixCache {
            unit_tokens,
            per_hash: (hash_tokens / unit_tokens) as usize,
            cache: HashMap::new(),
            units: Vec::new(),
            spare: Vec::new(),
            lru: BTreeMap::new(),
            next_stamp: 1,
            holders: HashMap::new(),
            shared_live_units: 0,
            stats: CacheStats::default(),
        }
    }

    pub fn unit_tokens(&self) -> u64 {
        self.unit_tokens
    }

    fn unit(&self, u: u32) -> &Unit<K> {
        self.units[u as usize].as_ref().expect("a live unit")
    }

    fn unit_mut(&mut self, u: u32) -> &mut Unit<K> {
        self.units[u as usize].as_mut().expect("a live unit")
    }

    /// Units no running request maps: what eviction can free.
    pub fn queued_units(&self) -> u64 {
        self.lru.len() as u64
    }

    /// Of `units`, those queued (no running request maps them).
    pub fn queued_among(&self, units: &[u32]) -> u64 {
        units.iter().filter(|&&u| self.units[u as usize].as_ref().is_some_and(|x| x.refs == 0 && x.stamp != 0)).count()
            as u64
    }

    /// Cached units, queued or mapped by running requests.
    pub fn cached_units(&self) -> u64 {
        self.cache.values().map(|v| v.len() as u64).sum()
    }

    /// Hash ids with at least one cached unit.
    pub fn cached_prefixes(&self) -> u64 {
        self.cache.values().filter(|v| !v.is_empty()).count() as u64
    }

    /// Finished requests kept as entries now.
    pub fn entries(&self) -> u64 {
        self.holders.values().filter(|h| !h.running).count() as u64
    }

    pub fn shared_live_units(&self) -> u64 {
        self.shared_live_units
    }

    /// The units allocation `k` maps at its start (empty if it maps none).
    pub fn holder_units(&self, k: K) -> usize {
        self.holders.get(&k).map_or(0, |h| h.units.len())
    }

    /// The longest cached prefix of a request with `prompt` tokens and the
    /// first `full_blocks` of `hash_ids` naming full blocks, as vLLM looks
    /// it up (`VllmMgr::lookup`), and a holder mapping all of it.
    pub fn lookup(&mut self, prompt: u64, hash_ids: &[u64], full_blocks: usize) -> Hit<K> {
        let (hit, mismatch) = self.find(prompt, hash_ids, full_blocks);
        self.stats.source_mismatches += mismatch as u64;
        hit
    }

    /// [`lookup`](Self::lookup) without counting: the hit, and whether the
    /// source's own units disagreed (the hit was cut there).
    pub fn find(&self, prompt: u64, hash_ids: &[u64], full_blocks: usize) -> (Hit<K>, bool) {
        let max_units = (prompt.saturating_sub(1) / self.unit_tokens) as usize;
        let mut units: Vec<u32> = Vec::new();
        for &h in &hash_ids[..full_blocks] {
            let Some(entry) = self.cache.get(&h) else { break };
            let take = entry.len().min(max_units - units.len());
            units.extend_from_slice(&entry[..take]);
            if units.len() == max_units || entry.len() < self.per_hash {
                break;
            }
        }
        let Some(&last) = units.last() else { return (Hit { units, source: None }, false) };
        let source = self.unit(last).origin;
        let mapped = &self.holders[&source].units;
        let agree = units.iter().zip(mapped).take_while(|(a, b)| a == b).count();
        let mismatch = agree < units.len();
        units.truncate(agree);
        (Hit { source: (!units.is_empty()).then_some(source), units }, mismatch)
    }

    /// Registers the running request `k`, which maps `hit` (from
    /// [`lookup`](Self::lookup)) at its start: those units leave the queue.
    pub fn acquire(&mut self, k: K, hit: &[u32]) {
        let mut h = Holder { units: hit.to_vec(), running: true, ..Holder::default() };
        for &u in hit {
            let unit = self.unit_mut(u);
            if unit.refs == 0 {
                let stamp = std::mem::take(&mut unit.stamp);
                h.taken.push((u, stamp));
                self.lru.remove(&stamp);
            } else {
                self.shared_live_units += 1;
            }
            let unit = self.unit_mut(u);
            unit.refs += 1;
            unit.holders.push(k);
        }
        if !hit.is_empty() {
            self.stats.hits += 1;
            self.stats.hit_units += hit.len() as u64;
        }
        let old = self.holders.insert(k, h);
        assert!(old.is_none(), "{k:?} registered twice");
    }

    /// Undoes [`acquire`](Self::acquire) for an admission that failed: the
    /// units go back to the queue where they were.
    pub fn abort(&mut self, k: K) {
        let h = self.holders.remove(&k).expect("an acquired holder");
        for &u in &h.units {
            let unit = self.unit_mut(u);
            unit.refs -= 1;
            unit.holders.retain(|&x| x != k);
            if unit.refs > 0 {
                self.shared_live_units -= 1;
            }
        }
        for (u, stamp) in h.taken {
            self.unit_mut(u).stamp = stamp;
            self.lru.insert(stamp, u);
        }
        if !h.units.is_empty() {
            self.stats.hits -= 1;
            self.stats.hit_units -= h.units.len() as u64;
        }
    }

    /// Caches the units the running request `k` computes (`VllmMgr`'s
    /// rule): for each of its prompt's first `computed` full hash blocks
    /// (of `full_blocks`), its units after what the cache held, if the
    /// cache's units for that hash are the ones `k` maps (its hit). Called
    /// once in its admission step, or, with chunked prefill, again as
    /// later steps compute more (blocks looked at before are not looked at
    /// again). Returns the units `k` now maps at its start.
    pub fn cache_own(&mut self, k: K, hash_ids: &[u64], full_blocks: usize, computed: usize) -> usize {
        let mut h = std::mem::take(self.holders.get_mut(&k).expect("an acquired holder"));
        h.taken.clear();
        let mut gap = h.gap;
        let from = h.scanned.min(computed);
        for (j, &hash) in hash_ids[..computed].iter().enumerate().skip(from) {
            let base = j * self.per_hash;
            let cached = self.cache.get(&hash).map_or(0, |e| e.len());
            let hit_here = h.units.len().saturating_sub(base).min(self.per_hash);
            if cached == self.per_hash && hit_here == self.per_hash {
                continue; // whole, and shared by this request
            }
            if gap || cached != hit_here || h.units.len() != base + hit_here {
                // Held by another copy (the last unit when the hit stops
                // below the last prompt token): `k` maps its own, uncached.
                if gap || j + 1 < full_blocks {
                    self.stats.uncached_after_gap += (self.per_hash - hit_here) as u64;
                }
                gap = true;
                continue;
            }
            for i in hit_here..self.per_hash {
                let unit = Unit {
                    hash,
                    index: i as u32,
                    pos: (base + i) as u32,
                    refs: 1,
                    stamp: 0,
                    origin: k,
                    holders: vec![k],
                };
                let u = match self.spare.pop() {
                    Some(u) => {
                        self.units[u as usize] = Some(unit);
                        u
                    }
                    None => {
                        self.units.push(Some(unit));
                        (self.units.len() - 1) as u32
                    }
                };
                self.cache.entry(hash).or_default().push(u);
                h.units.push(u);
                h.originated += 1;
            }
        }
        h.scanned = h.scanned.max(computed);
        h.gap = gap;
        let n = h.units.len();
        *self.holders.get_mut(&k).expect("an acquired holder") = h;
        n
    }

    /// The running request `k` ends (finished or preempted): its units join
    /// the queue, last first, where no other running request maps them.
    pub fn release(&mut self, k: K) -> Release {
        let h = self.holders.get_mut(&k).expect("a running holder");
        assert!(h.running, "{k:?} released twice");
        h.running = false;
        let units = h.units.clone();
        let originated = h.originated;
        for &u in units.iter().rev() {
            let stamp = self.next_stamp;
            let unit = self.unit_mut(u);
            unit.refs -= 1;
            if unit.refs > 0 {
                self.shared_live_units -= 1;
            } else {
                unit.stamp = stamp;
                self.lru.insert(stamp, u);
                self.next_stamp += 1;
            }
        }
        if originated == 0 {
            self.drop_holder(k);
            if !units.is_empty() {
                self.stats.duplicates_freed += 1;
            }
            Release::Free(units.len())
        } else {
            self.stats.entries_kept += 1;
            Release::Keep(units.len())
        }
    }

    fn drop_holder(&mut self, k: K) {
        let h = self.holders.remove(&k).expect("a holder");
        for u in h.units {
            self.unit_mut(u).holders.retain(|&x| x != k);
        }
    }

    /// Evicts at least `n` units (fewer if fewer are queued), oldest first.
    /// Returns, for every entry that changed, the units it keeps
    /// ([`Release::Keep`]) or [`Release::Free`].
    pub fn evict(&mut self, n: u64) -> Vec<(K, Release)> {
        let mut changed: Vec<K> = Vec::new();
        let mut evicted = 0u64;
        while evicted < n {
            let Some((_, first)) = self.lru.pop_first() else { break };
            evicted += self.evict_unit(first, &mut changed);
        }
        self.settle(changed, None)
    }

    /// Evicts one queued unit (cutting its hash's chain there: its later
    /// units go too) and truncates every holder that maps it. Returns the
    /// units evicted.
    fn evict_unit(&mut self, first: u32, changed: &mut Vec<K>) -> u64 {
        let mut evicted = 0;
        let stamp = std::mem::take(&mut self.unit_mut(first).stamp);
        self.lru.remove(&stamp);
        let mut work = vec![first];
        while let Some(u) = work.pop() {
            let Some(unit) = self.units[u as usize].as_ref() else { continue };
            // Cut the hash's chain at this unit: it and its later units go.
            let (hash, index) = (unit.hash, unit.index as usize);
            let entry = self.cache.get_mut(&hash).expect("a cached unit's hash");
            let ids: Vec<u32> = entry.drain(index..).collect();
            if entry.is_empty() {
                self.cache.remove(&hash);
            }
            // All of them leave the books before any holder is cut, so a
            // holder's later units in this set are not counted as cascades.
            let dead: Vec<(u32, Unit<K>)> =
                ids.into_iter().map(|d| (d, self.units[d as usize].take().expect("a cached unit"))).collect();
            for (d, unit) in dead {
                assert_eq!(unit.refs, 0, "an evicted unit is mapped by a running request");
                if unit.stamp != 0 {
                    self.lru.remove(&unit.stamp);
                }
                self.spare.push(d);
                evicted += 1;
                self.stats.evicted_units += 1;
                if let Some(o) = self.holders.get_mut(&unit.origin) {
                    o.originated -= 1;
                }
                for k in unit.holders {
                    let h = self.holders.get_mut(&k).expect("a unit's holder");
                    assert!(!h.running, "a running holder maps an evicted unit");
                    let pos = unit.pos as usize;
                    if h.units.len() > pos && h.units[pos] == d {
                        // Everything after it in this holder goes too; a
                        // unit left unmapped by its origin is evicted.
                        for &later in &h.units[pos + 1..] {
                            if let Some(l) = self.units[later as usize].as_mut() {
                                l.holders.retain(|&x| x != k);
                                if l.holders.is_empty() || l.origin == k {
                                    self.stats.cascade_evictions += 1;
                                    work.push(later);
                                }
                            }
                        }
                        h.units.truncate(pos);
                        if !changed.contains(&k) {
                            changed.push(k);
                        }
                    }
                }
            }
        }
        evicted
    }

    /// The entries that changed, as [`Release`]s; those left empty or with
    /// nothing they computed leave the books. `keep` is not settled.
    fn settle(&mut self, changed: Vec<K>, keep: Option<K>) -> Vec<(K, Release)> {
        changed
            .into_iter()
            .filter(|&k| Some(k) != keep)
            .filter_map(|k| {
                let (len, originated) = self.holders.get(&k).map(|h| (h.units.len(), h.originated))?;
                if len == 0 || originated == 0 {
                    if len > 0 {
                        self.stats.duplicates_freed += 1;
                    }
                    self.drop_holder(k);
                    Some((k, Release::Free(len)))
                } else {
                    Some((k, Release::Keep(len)))
                }
            })
            .collect()
    }

    /// An admission with `hit` that needs `need` units evicted may take
    /// over an entry instead of a new allocation: one that maps `hit` at its
    /// start and whose other units are the oldest queued (all among the
    /// `max(need, their number)` oldest: LRU eviction gives them up first).
    /// They are evicted (those beyond `need` early, and counted), the rest
    /// of `need` as usual, and the entry becomes the
    /// running request's allocation: its chunks past the hit are reused
    /// where they are mapped, where a new allocation would have to unmap
    /// them there and map them again. Returns the entry and the other
    /// entries that changed.
    ///
    /// An entry that maps exactly `hit` (nothing of its own past it) is
    /// taken over even when nothing is to be evicted: it evicts nothing,
    /// and the hit is used where the entry maps it instead of being mapped
    /// at a new allocation's addresses (a request back after a preemption,
    /// or the next turn of a conversation, finds its own prefix so).
    pub fn take_over(&mut self, hit: &[u32], need: u64) -> Option<(K, Vec<(K, Release)>)> {
        if need == 0 && hit.is_empty() {
            return None;
        }
        // The hit leaves the queue first: eviction must not take it.
        let mut taken = Vec::new();
        for &u in hit {
            let unit = self.unit_mut(u);
            if unit.refs == 0 && unit.stamp != 0 {
                let stamp = std::mem::take(&mut unit.stamp);
                taken.push((u, stamp));
                self.lru.remove(&stamp);
            }
        }
        let restore = |c: &mut Self, taken: Vec<(u32, u64)>| {
            for (u, stamp) in taken {
                c.unit_mut(u).stamp = stamp;
                c.lru.insert(stamp, u);
            }
        };
        if need > self.lru.len() as u64 {
            restore(self, taken);
            return None;
        }
        let m = hit.len();
        let candidates: Vec<K> = match hit.last() {
            Some(&u) => self.unit(u).holders.clone(),
            None => vec![self.unit(*self.lru.values().next().expect("queued")).origin],
        };
        // An entry fits if its units past the hit are the oldest queued:
        // all among the max(need, its tail) oldest.
        let fits = |h: &Holder| {
            if h.running || h.units.len() < m || h.units[..m] != *hit {
                return false;
            }
            let tail = &h.units[m..];
            if tail.is_empty() {
                return m > 0; // nothing of its own to evict
            }
            if need == 0 {
                return false; // its tail would go before LRU takes it
            }
            let n = need.max(tail.len() as u64);
            let Some(&bound) = self.lru.keys().nth(n as usize - 1) else { return false };
            tail.iter().all(|&u| {
                let unit = self.units[u as usize].as_ref().expect("a live unit");
                unit.refs == 0 && unit.stamp != 0 && unit.stamp <= bound
            })
        };
        let Some(k) =
            candidates.into_iter().filter(|k| fits(&self.holders[k])).max_by_key(|k| self.holders[k].units.len())
        else {
            restore(self, taken);
            return None;
        };
        let mut changed = Vec::new();
        let mut evicted = 0;
        while self.holders[&k].units.len() > m {
            let tail = *self.holders[&k].units.last().expect("longer than the hit");
            evicted += self.evict_unit(tail, &mut changed);
        }
        while evicted < need {
            let Some((_, first)) = self.lru.pop_first() else { break };
            evicted += self.evict_unit(first, &mut changed);
        }
        let others = self.settle(changed, Some(k));
        // The entry runs again, mapping the hit (as `acquire`).
        let h = self.holders.get_mut(&k).expect("the entry");
        h.running = true;
        h.taken = taken;
        // A new request: its blocks are looked at afresh.
        (h.scanned, h.gap) = (0, false);
        for &u in hit {
            let unit = self.units[u as usize].as_mut().expect("a hit unit");
            if unit.refs > 0 {
                self.shared_live_units += 1;
            }
            unit.refs += 1;
        }
        if m > 0 {
            self.stats.hits += 1;
            self.stats.hit_units += m as u64;
        }
        self.stats.take_overs += 1;
        self.stats.early_evicted_units += evicted.saturating_sub(need);
        Some((k, others))
    }

    /// Checks the books: every queued unit has no running user, every
    /// holder's units sit at their positions, every unit's origin maps it.
    pub fn check(&self) -> Result<(), String> {
        for (&stamp, &u) in &self.lru {
            let unit = self.units[u as usize].as_ref().ok_or("a dead unit queued")?;
            if unit.refs != 0 || unit.stamp != stamp {
                return Err(format!("unit {u} queued with refs {} stamp {}", unit.refs, unit.stamp));
            }
        }
        let mut shared = 0;
        for (u, unit) in self.units.iter().enumerate() {
            let Some(unit) = unit else { continue };
            let running = unit.holders.iter().filter(|k| self.holders[k].running).count() as u32;
            if running != unit.refs {
                return Err(format!("unit {u}: refs {} but {running} running holders", unit.refs));
            }
            shared += running.saturating_sub(1) as u64;
            if (unit.refs == 0) != (unit.stamp != 0) {
                return Err(format!("unit {u}: refs {} stamp {}", unit.refs, unit.stamp));
            }
            if !unit.holders.contains(&unit.origin) {
                return Err(format!("unit {u}: its origin does not map it"));
            }
            for k in &unit.holders {
                if self.holders[k].units.get(unit.pos as usize) != Some(&(u as u32)) {
                    return Err(format!("unit {u}: holder {k:?} does not map it at {}", unit.pos));
                }
            }
        }
        if shared != self.shared_live_units {
            return Err(format!("shared live units {} counted, {shared} found", self.shared_live_units));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 4-token units, 8-token hash blocks (2 units each).
    fn cache() -> PrefixCache<u32> {
        PrefixCache::new(4, 8)
    }

    fn admit(c: &mut PrefixCache<u32>, k: u32, prompt: u64, hashes: &[u64]) -> (usize, Option<u32>) {
        let full = ((prompt / 8) as usize).min(hashes.len());
        let hit = c.lookup(prompt, hashes, full);
        c.acquire(k, &hit.units);
        c.cache_own(k, hashes, full, full);
        c.check().unwrap();
        (hit.units.len(), hit.source)
    }

    #[test]
    fn hits_follow_the_chain_and_stop_before_the_last_prompt_token() {
        let mut c = cache();
        assert_eq!(admit(&mut c, 1, 17, &[10, 11]), (0, None));
        assert_eq!(c.cached_units(), 4);
        // The same chain, prompt 16: hits stop below token 15, so 3 units.
        assert_eq!(admit(&mut c, 2, 16, &[10, 11]), (3, Some(1)));
        // A chain that diverges at its second hash: the first hash only.
        assert_eq!(admit(&mut c, 3, 20, &[10, 12]), (2, Some(1)));
        assert_eq!(c.shared_live_units(), 3 + 2);
        assert_eq!(c.release(2), Release::Free(3), "2 computed nothing the cache keeps");
        assert_eq!(c.release(3), Release::Keep(4));
        assert_eq!(c.release(1), Release::Keep(4));
        assert_eq!(c.shared_live_units(), 0);
        assert_eq!((c.queued_units(), c.entries(), c.stats.duplicates_freed), (6, 2, 1));
        c.check().unwrap();
    }

    /// Eviction in LRU order, tail first, and a cut chain completed.
    #[test]
    fn eviction_is_lru_and_cuts_the_chain() {
        let mut c = cache();
        admit(&mut c, 1, 17, &[10, 11]); // units a0 a1 (h10), b0 b1 (h11)
        assert_eq!(c.release(1), Release::Keep(4)); // queue: b1 b0 a1 a0
        admit(&mut c, 2, 17, &[20]); // its own chain: c0 c1
        assert_eq!(c.release(2), Release::Keep(2)); // queue: b1 b0 a1 a0 c1 c0
                                                    // Two units: h11's both (the oldest), entry 1 shrinks to h10.
        assert_eq!(c.evict(2), vec![(1, Release::Keep(2))]);
        assert_eq!(c.stats.evicted_units, 2);
        // [10 11] now hits h10 only, from entry 1, and completes h11.
        assert_eq!(admit(&mut c, 3, 17, &[10, 11]), (2, Some(1)));
        assert_eq!(c.cached_units(), 6);
        assert_eq!(c.release(3), Release::Keep(4)); // queue: c1 c0 b1' b0' a1 a0
                                                    // Evicting one unit takes c1 (entry 2's tail), then c0 frees entry 2.
        assert_eq!(c.evict(1), vec![(2, Release::Keep(1))]);
        assert_eq!(c.evict(1), vec![(2, Release::Free(0))]);
        // Next h11's new units, entry 3's tail: left with h10 only, which it
        // shares from entry 1, entry 3 is a duplicate and is freed.
        assert_eq!(c.evict(2), vec![(3, Release::Free(2))]);
        assert_eq!(c.stats.duplicates_freed, 1);
        assert_eq!(c.evict(1), vec![(1, Release::Keep(1))]);
        assert_eq!(c.evict(5), vec![(1, Release::Free(0))], "fewer queued than asked");
        assert_eq!(c.stats.evicted_units, 8);
        assert_eq!((c.cached_units(), c.queued_units(), c.entries()), (0, 0, 0));
        assert_eq!((c.stats.cascade_evictions, c.stats.source_mismatches, c.stats.uncached_after_gap), (0, 0, 0));
        c.check().unwrap();
    }

    #[test]
    fn units_in_use_are_never_evicted_and_abort_restores_the_queue() {
        let mut c = cache();
        admit(&mut c, 1, 17, &[10]);
        c.release(1); // queue: a1 a0
        let hit = c.lookup(17, &[10], 1);
        c.acquire(2, &hit.units);
        assert_eq!(c.queued_units(), 0);
        assert_eq!(c.evict(4), vec![], "nothing queued");
        c.abort(2);
        assert_eq!((c.queued_units(), c.stats.hits), (2, 0));
        c.check().unwrap();
        // The order is intact: the tail still goes first.
        assert_eq!(c.evict(1), vec![(1, Release::Keep(1))]);
    }

    /// An admission sharing h10 that needs two units evicted takes over
    /// entry 1 (which maps h10, and whose h11 units are the two oldest),
    /// not entry 2 (its h12 units were queued later).
    #[test]
    fn take_over_reuses_the_entry_whose_tail_lru_would_evict() {
        let mut c = cache();
        admit(&mut c, 1, 17, &[10, 11]); // a0 a1 b0 b1
        c.release(1); // queue: b1 b0 a1 a0
        admit(&mut c, 2, 17, &[10, 12]); // shares a0 a1, computes c0 c1
        c.release(2); // queue: b1 b0 c1 c0 a1 a0
        let hit = c.lookup(17, &[10, 13], 2);
        assert_eq!((hit.units.len(), hit.source), (2, Some(1)));
        assert_eq!(c.take_over(&hit.units, 0), None, "nothing to evict: a new allocation shares the hit");
        let (k, others) = c.take_over(&hit.units, 2).expect("entry 1 fits");
        assert_eq!((k, others), (1, vec![]));
        assert_eq!((c.stats.evicted_units, c.stats.take_overs, c.stats.hits), (2, 1, 2));
        assert_eq!(c.cache_own(1, &[10, 13], 2, 2), 4, "h10, then h13 cached in entry 1's own place");
        c.check().unwrap();
        assert_eq!(c.shared_live_units(), 0);
        // Entry 2's tail is not among the 2 oldest now (c1 c0 are), but for 3
        // units a request without a hit takes nothing: h10's units are in use.
        assert_eq!(c.take_over(&[], 3), None);
    }

    #[test]
    fn an_entry_that_is_exactly_the_hit_is_taken_over_with_nothing_to_evict() {
        let mut c = cache();
        admit(&mut c, 1, 17, &[10, 11]); // a0 a1 b0 b1
        c.release(1); // queue: b1 b0 a1 a0
        let hit = c.lookup(17, &[10, 11], 2);
        assert_eq!((hit.units.len(), hit.source), (4, Some(1)));
        let (k, others) = c.take_over(&hit.units, 0).expect("entry 1 maps exactly the hit");
        assert_eq!((k, others), (1, vec![]));
        assert_eq!((c.stats.evicted_units, c.stats.take_overs, c.stats.hits), (0, 1, 1));
        assert_eq!(c.queued_units(), 0, "the hit left the queue, nothing was evicted");
        c.check().unwrap();
        // Running now: not taken over again (another request shares it).
        assert_eq!(c.take_over(&hit.units, 0), None);
        c.check().unwrap();
        // A shorter hit than entry 1 holds does not take its tail early
        // when nothing is to be evicted.
        c.release(1);
        let short = c.lookup(9, &[10], 1);
        assert_eq!(short.units.len(), 2);
        assert_eq!(c.take_over(&short.units, 0), None);
        assert_eq!(c.queued_units(), 4, "the failed take-over put the hit back");
        c.check().unwrap();
    }
}
