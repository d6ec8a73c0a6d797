//! The model's physical side: which chunk backs each awake page (so which
//! allocations share chunks), what each chunk holds, and the sleepers'
//! sharing groups, as `arena/alias.rs` keeps them.

use super::*;

pub struct Chunk {
    /// The seed of the stamps it holds.
    pub seed: u64,
    /// Backing pages of awake allocations that map it.
    pub awake: u32,
}

/// A sleeper's page: its own backup (the stamps' seed), or a group.
#[derive(Clone, Copy)]
pub enum Slept {
    Own(u64),
    Group(u64),
}

struct Member {
    key: usize,
    page: usize,
    /// When it slept (the newest backup fills a group's new chunk).
    seq: u64,
    /// Its backup of the page.
    seed: u64,
}

struct Group {
    /// The chunk an awake allocation still maps.
    chunk: Option<usize>,
    members: Vec<Member>,
}

#[derive(Default)]
pub struct Chunks {
    pub all: Vec<Chunk>,
    groups: BTreeMap<u64, Group>,
    /// The group of each chunk an awake allocation maps.
    group_of: BTreeMap<usize, u64>,
    next: u64,
}

impl Chunks {
    /// A new chunk, mapped by one awake page.
    pub fn create(&mut self, seed: u64) -> usize {
        self.all.push(Chunk { seed, awake: 1 });
        self.all.len() - 1
    }

    /// Distinct chunks that awake allocations map.
    pub fn mapped(&self) -> u64 {
        self.all.iter().filter(|c| c.awake > 0).count() as u64
    }

    /// Chunks more than one awake page maps.
    pub fn shared(&self) -> u64 {
        self.all.iter().filter(|c| c.awake > 1).count() as u64
    }

    pub fn awake_sharer(&self, h: usize) -> bool {
        self.all[h].awake > 1
    }

    /// A sleeper will map `h` again when it wakes.
    pub fn sleeper_sharer(&self, h: usize) -> bool {
        self.group_of.contains_key(&h)
    }

    /// One more awake page maps `h`.
    pub fn map_again(&mut self, h: usize) {
        self.all[h].awake += 1;
    }

    /// One awake page stops mapping `h`; the last one ends its group's chunk.
    pub fn unmap(&mut self, h: usize) {
        self.all[h].awake -= 1;
        if self.all[h].awake == 0 {
            if let Some(g) = self.group_of.remove(&h) {
                self.groups.get_mut(&g).unwrap().chunk = None;
            }
        }
    }

    /// Allocation `key`'s awake pages `chunks` sleep: a page whose chunk
    /// another page maps, or a group remembers, joins the chunk's group.
    pub fn sleep(&mut self, key: usize, chunks: &[usize]) -> Vec<Slept> {
        self.next += 1;
        let seq = self.next;
        let mut slept = Vec::new();
        for (page, &h) in chunks.iter().enumerate() {
            let seed = self.all[h].seed;
            if self.awake_sharer(h) || self.sleeper_sharer(h) {
                let g = match self.group_of.get(&h) {
                    Some(&g) => g,
                    None => {
                        self.next += 1;
                        self.group_of.insert(h, self.next);
                        self.groups.insert(self.next, Group { chunk: Some(h), members: Vec::new() });
                        self.next
                    }
                };
                self.groups.get_mut(&g).unwrap().members.push(Member { key, page, seq, seed });
                slept.push(Slept::Group(g));
                seen("a sleeper joins a group");
            } else {
                slept.push(Slept::Own(seed));
            }
            self.unmap(h);
        }
        slept
    }

    /// New chunks waking these pages takes: one per own page, one per
    /// group that no awake allocation maps any more.
    pub fn wake_needs(&self, slept: &[Slept]) -> u64 {
        let groups: BTreeSet<u64> = (slept.iter())
            .filter_map(|s| match *s {
                Slept::Group(g) if self.groups[&g].chunk.is_none() => Some(g),
                _ => None,
            })
            .collect();
        slept.iter().filter(|s| matches!(s, Slept::Own(_))).count() as u64 + groups.len() as u64
    }

    /// The pages wake: an own page gets a new chunk with its backup; a
    /// group's page maps the group's chunk again, or gets the group a new
    /// one holding the newest member's backup. Returns the chunks.
    pub fn wake(&mut self, key: usize, slept: &[Slept]) -> Vec<usize> {
        let mut chunks = Vec::new();
        for s in slept {
            let h = match *s {
                Slept::Own(seed) => self.create(seed),
                Slept::Group(g) => match self.groups[&g].chunk {
                    Some(h) => {
                        self.map_again(h);
                        seen("a waker maps its group's chunk again");
                        h
                    }
                    None => {
                        let newest = self.groups[&g].members.iter().max_by_key(|m| m.seq).unwrap().seed;
                        let h = self.create(newest);
                        self.groups.get_mut(&g).unwrap().chunk = Some(h);
                        self.group_of.insert(h, g);
                        seen("a waker gets its group a new chunk");
                        h
                    }
                },
            };
            chunks.push(h);
        }
        self.leave(key, slept);
        chunks
    }

    /// Sleeper `key` leaves its groups (it woke or was freed).
    pub fn leave(&mut self, key: usize, slept: &[Slept]) {
        for (page, s) in slept.iter().enumerate() {
            let Slept::Group(g) = *s else { continue };
            let grp = self.groups.get_mut(&g).unwrap();
            grp.members.retain(|m| (m.key, m.page) != (key, page));
            if grp.members.is_empty() {
                if let Some(h) = grp.chunk {
                    self.group_of.remove(&h);
                }
                self.groups.remove(&g);
            }
        }
    }
}
