//! Applying `sleep` and `wake` to the arena and the model: who sleeps, what
//! each page's bytes are on waking under the contract's sharing rules, and
//! what the wake needs of the capacity.

use std::collections::BTreeSet;

use vmm_arena::{Id, Status, ALL_TAGS, SLEEP_BACKUP};

use super::fault::Faulted;
use super::model::{marks_in_page, Marks, Slept};
use super::{count, Harness};

impl Harness {
    pub(super) fn sleep(&mut self, tag: u32, backup: bool) {
        let (r, f) = self.call("sleep", false, |a| a.sleep(tag, if backup { SLEEP_BACKUP } else { 0 }));
        if let Faulted::RolledBack = f {
            return count("sleep rolled back after a fault");
        }
        r.unwrap();
        if self.absorbed_now {
            count("sleep kept a chunk whose release failed");
        }
        let selected: Vec<Id> = self
            .live
            .iter()
            // Small allocations sleep with their slab, which holds one tag's.
            .filter(|(_, m)| !m.asleep && (tag == ALL_TAGS || m.tag == tag || m.tag == ALL_TAGS))
            .map(|(&id, _)| id)
            .collect();
        // A page shared with any other live allocation (awake, or asleep in
        // the chunk's group) joins the group.
        let mut shared_pages = 0;
        let mut kept_pages = 0;
        let sleepers: Vec<(Id, Vec<bool>)> = selected
            .iter()
            .map(|&id| {
                let grouped: Vec<bool> = self.live[&id]
                    .chunks
                    .iter()
                    .map(|k| self.live.iter().any(|(&o, om)| o != id && om.chunks.contains(k)))
                    .collect();
                shared_pages += grouped.iter().filter(|&&g| g).count();
                kept_pages += self.live[&id]
                    .chunks
                    .iter()
                    .filter(|&&k| self.awake_holders(k).iter().any(|(o, _)| !selected.contains(o)))
                    .count();
                (id, grouped)
            })
            .collect();
        for (id, grouped) in sleepers {
            self.sleeps += 1;
            let seq = self.sleeps;
            let m = self.live.get_mut(&id).unwrap();
            m.asleep = true;
            if std::mem::take(&mut m.quiesced) {
                // Waking restores its bytes and the caller's work.
                count("sleep ended a promise");
            }
            let marks = std::mem::take(&mut m.stamps.marks);
            m.slept = Some(Slept { backup: backup.then_some(marks), seq, grouped });
        }
        count(match (selected.is_empty(), backup) {
            (true, _) => "sleep idle",
            (false, false) => "sleep",
            (false, true) => "sleep with backup",
        });
        if selected.iter().any(|id| self.live[id].small) {
            count(if backup { "sleep of small allocations with backup" } else { "sleep of small allocations" });
        }
        if shared_pages > 0 {
            count("sleep of sharers");
        }
        if kept_pages > 0 {
            count("sleep kept a chunk an awake allocation maps");
        }
        let kept = self.absorbed_now;
        self.ran_ok();
        self.check("sleep", &[]);
        // Every pooled chunk goes back, but one whose release failed (which
        // the retain watermark, applied after the operation, may give back).
        let s = &self.snap.stats;
        assert!(s["pooled_bytes"] <= if kept { self.c } else { 0 }, "sleep gives back what is pooled");
        assert_eq!(s["retired_va_bytes"], 0, "sleep releases the retired ranges");
    }

    pub(super) fn wake(&mut self, tag: u32) {
        let c = self.c;
        let selected: Vec<Id> = self
            .live
            .iter()
            .filter(|(_, m)| m.asleep && (tag == ALL_TAGS || m.tag == tag || m.tag == ALL_TAGS))
            .map(|(&id, _)| id)
            .collect();
        // New chunks needed: one per model chunk no awake allocation maps
        // (a group's, once for all its members).
        let mut dead: BTreeSet<u64> = BTreeSet::new();
        for id in &selected {
            for &k in &self.live[id].chunks {
                if self.awake_holders(k).is_empty() {
                    dead.insert(k);
                }
            }
        }
        // And a chunk for each sleeping slab of the tag.
        let slabs = self
            .snap
            .slabs()
            .filter(|r| r.asleep && (tag == ALL_TAGS || r.tag == tag as u64 || r.tag == ALL_TAGS as u64))
            .count();
        let needed = (dead.len() + slabs) as u64;
        let obtainable = self.obtainable();
        // Chunks of slabs holding only retired objects come back only when
        // retired memory is released, which wake does not do.
        let idle_slabs = self.snap.slabs().filter(|r| r.used == 0).count() as u64;
        let (r, f) = self.call("wake", false, |a| a.wake(tag));
        if let Faulted::RolledBack = f {
            return count("wake rolled back after a fault");
        }
        match r {
            Ok(()) => {
                count(if needed > 0 || !selected.is_empty() { "wake" } else { "wake idle" });
                assert!(needed <= obtainable, "woke {needed} pages beyond the capacity");
                // Each page's bytes, from the books before the wake: a chunk
                // an awake allocation maps, as it is now; a group's new
                // chunk, byte by byte the backup of the member that slept
                // last with one covering that byte; any other new chunk, its
                // own backup.
                let mut restored: Vec<(Id, Marks)> = Vec::new();
                for &id in &selected {
                    let m = &self.live[&id];
                    let z = m.slept.as_ref().expect("a sleeper");
                    let mut marks = Vec::new();
                    if m.small {
                        // Its slab's backup (the whole chunk) holds its bytes.
                        marks = z.backup.clone().unwrap_or_default();
                    }
                    for (i, &k) in m.chunks.iter().enumerate() {
                        let i = i as u64;
                        let from: Option<Marks> = if let Some(&(h, j)) = self.awake_holders(k).first() {
                            Some(marks_in_page(&self.live[&h].stamps.marks, j, c))
                        } else if z.grouped[i as usize] {
                            // Byte by byte, the newest backup covering it: a
                            // member backed up its size, so only a prefix of
                            // a page its size ends in. Overlaid oldest first,
                            // each replacing what the older ones said there.
                            let mut members: Vec<(u64, u64, Marks)> = self
                                .live
                                .values()
                                .filter_map(|o| {
                                    let oz = o.slept.as_ref()?;
                                    let j = o.chunks.iter().position(|&x| x == k)? as u64;
                                    let b = oz.backup.as_ref()?;
                                    Some((oz.seq, (o.size - j * c).min(c), marks_in_page(b, j, c)))
                                })
                                .collect();
                            members.sort_by_key(|&(seq, _, _)| seq);
                            let mut page: Option<Marks> = None;
                            for (_, covers, pieces) in members {
                                let acc = page.get_or_insert_with(Vec::new);
                                acc.retain(|(o, _)| *o >= covers);
                                acc.extend(pieces);
                            }
                            page
                        } else {
                            z.backup.as_ref().map(|b| marks_in_page(b, i, c))
                        };
                        for (off, bytes) in from.unwrap_or_default() {
                            let at = i * c + off;
                            if at < m.size {
                                let keep = (m.size - at).min(bytes.len() as u64) as usize;
                                marks.push((at, bytes[..keep].to_vec()));
                            }
                        }
                    }
                    restored.push((id, marks));
                }
                for (id, marks) in restored {
                    let m = self.live.get_mut(&id).unwrap();
                    m.asleep = false;
                    m.slept = None;
                    m.stamps.marks = marks;
                }
                self.ran_ok();
                // check() verifies the woken stamps.
                self.check("wake", &[]);
            }
            Err(e) => {
                count("wake out of memory");
                assert_eq!(e.status(), Status::OutOfMemory, "{e}");
                assert!(needed > obtainable - idle_slabs, "OutOfMemory waking {needed} of {obtainable} pages: {e}");
                self.check("failed wake", &[]);
            }
        }
    }
}
