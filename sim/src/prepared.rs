//! Admissions prepared between steps (`KvManager::prepare_admissions`): the
//! outcomes of the next step's first admissions, worked out while the GPU
//! computes the current step, and handed out by `admit` in the same order.
//!
//! The replay passes exactly the requests the next admission tries first,
//! in its order, and nothing changes the manager in between; a manager
//! runs its ordinary admission for each of them then, stopping after the
//! first that fails (admission stops there too). The book is pure: it
//! keeps each outcome with the shared-prefix bytes that admission added to
//! the running requests' sharing (so that the sharing reported while the
//! prepared requests are not yet running leaves them out), and says when
//! `admit` asks for something else than what was prepared (then the
//! preparation was wrong and the manager gives its allocations back).

use std::collections::VecDeque;

use super::managers::Fail;

/// One prepared admission.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub seq: usize,
    pub tokens: u64,
    /// What `admit` returns: the prefix hit, or the failure.
    pub outcome: Result<u64, Fail>,
    /// Bytes this admission added to the running requests' shared KV.
    pub shared_bytes: u64,
}

/// What [`PreparedAdmissions::take`] found.
#[derive(Debug)]
pub enum Take {
    /// The next prepared admission is this one: its outcome.
    Ready(Result<u64, Fail>),
    /// Nothing is prepared: admit as usual.
    NotPrepared,
    /// Something else was prepared: these (in preparation order) were
    /// never admitted and must be given back; then admit as usual.
    Stale(Vec<Prepared>),
}

/// The prepared admissions of the next step, in order, and counts.
#[derive(Debug, Default)]
pub struct PreparedAdmissions {
    queue: VecDeque<Prepared>,
    /// Admissions prepared, those that failed, those handed out by `admit`,
    /// and those given back unused (0 when the replay passes what it admits).
    pub prepared: u64,
    pub failed: u64,
    pub used: u64,
    pub stale: u64,
    /// Preparations a manager stopped before a request it chose not to
    /// prepare (left to admission).
    pub deferred: u64,
}

impl PreparedAdmissions {
    /// Whether a preparation failed last: nothing may follow it.
    pub fn ended(&self) -> bool {
        self.queue.back().is_some_and(|p| p.outcome.is_err())
    }

    /// Records an admission prepared after the others.
    pub fn push(&mut self, p: Prepared) {
        assert!(!self.ended(), "nothing is prepared after a failure");
        self.prepared += 1;
        self.failed += p.outcome.is_err() as u64;
        self.queue.push_back(p);
    }

    /// The outcome for `admit(seq, tokens)`: the next prepared one if it is
    /// that admission, else every prepared one as stale.
    pub fn take(&mut self, seq: usize, tokens: u64) -> Take {
        match self.queue.front() {
            None => Take::NotPrepared,
            Some(p) if p.seq == seq && p.tokens == tokens => {
                self.used += 1;
                Take::Ready(self.queue.pop_front().expect("a front").outcome)
            }
            Some(_) => Take::Stale(self.drain()),
        }
    }

    /// Takes every prepared admission out (counted as stale): for a new
    /// preparation, which must not find any left.
    pub fn drain(&mut self) -> Vec<Prepared> {
        self.stale += self.queue.len() as u64;
        self.queue.drain(..).collect()
    }

    /// Whether the next prepared admission is `admit(seq, tokens)`'s.
    pub fn front_is(&self, seq: usize, tokens: u64) -> bool {
        self.queue.front().is_some_and(|p| p.seq == seq && p.tokens == tokens)
    }

    /// The prefix hit of `seq`'s prepared admission, where it is prepared
    /// and succeeded (what its token count was worked out from).
    pub fn hit_of(&self, seq: usize) -> Option<u64> {
        self.queue.iter().find(|p| p.seq == seq).and_then(|p| p.outcome.as_ref().ok().copied())
    }

    /// Shared bytes of the prepared admissions not handed out yet.
    pub fn shared_bytes(&self) -> u64 {
        self.queue.iter().map(|p| p.shared_bytes).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(seq: usize, hit: u64, shared: u64) -> Prepared {
        Prepared { seq, tokens: 100 + seq as u64, outcome: Ok(hit), shared_bytes: shared }
    }

    fn fail(seq: usize) -> Prepared {
        let f = Fail { fragmentation: false, host_limit: false, message: "full".into() };
        Prepared { seq, tokens: 100 + seq as u64, outcome: Err(f), shared_bytes: 0 }
    }

    #[test]
    fn outcomes_come_out_in_order_once_and_shared_bytes_follow() {
        let mut b = PreparedAdmissions::default();
        b.push(ok(3, 16, 2));
        b.push(ok(5, 0, 0));
        b.push(fail(7));
        assert!(b.ended());
        assert_eq!(b.shared_bytes(), 2);
        assert_eq!((b.hit_of(3), b.hit_of(5), b.hit_of(7), b.hit_of(9)), (Some(16), Some(0), None, None));
        assert!(matches!(b.take(3, 103), Take::Ready(Ok(16))));
        assert_eq!(b.shared_bytes(), 0);
        assert!(matches!(b.take(5, 105), Take::Ready(Ok(0))));
        assert!(matches!(b.take(7, 107), Take::Ready(Err(_))));
        // After the prepared failure admission goes on as usual.
        assert!(matches!(b.take(8, 108), Take::NotPrepared));
        assert_eq!((b.prepared, b.failed, b.used, b.stale), (3, 1, 3, 0));
        assert!(b.is_empty());
    }

    #[test]
    fn another_admission_or_token_count_makes_the_rest_stale() {
        let mut b = PreparedAdmissions::default();
        b.push(ok(3, 16, 2));
        b.push(ok(5, 0, 1));
        let Take::Stale(left) = b.take(3, 999) else { panic!("the token count differs") };
        assert_eq!(left.iter().map(|p| p.seq).collect::<Vec<_>>(), vec![3, 5]);
        assert_eq!((b.stale, b.used, b.shared_bytes()), (2, 0, 0));
        b.push(ok(4, 0, 0));
        assert!(matches!(b.take(9, 109), Take::Stale(_)));
        assert_eq!(b.stale, 3);
    }

    #[test]
    #[should_panic(expected = "after a failure")]
    fn nothing_is_prepared_after_a_failure() {
        let mut b = PreparedAdmissions::default();
        b.push(fail(1));
        b.push(ok(2, 0, 0));
    }
}
