//! Small allocations: packing into slabs, moves with their slab, resize
//! beyond the class by copying, pinning, ids.

use std::sync::{Arc, Mutex};

use vmm_arena::{Arena, ArenaConfig, Error, MoveEvent};

const C: u64 = 2 << 20;

fn arena(chunks: u64) -> Arena {
    Arena::new(ArenaConfig { capacity_bytes: chunks * C, reserve_bytes: 2 * chunks * C, ..Default::default() }).unwrap()
}

fn pattern(id: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (id.wrapping_mul(31).wrapping_add(i as u64 * 7)) as u8).collect()
}

fn check(a: &Arena, id: vmm_arena::Id, len: usize) {
    let mut buf = vec![0u8; len];
    a.read(id, 0, &mut buf).unwrap();
    assert_eq!(buf, pattern(id.get(), len), "bytes of {id}");
}

#[test]
fn small_allocations_share_chunks_and_are_aligned() {
    let a = arena(16);
    let mut ids = Vec::new();
    for i in 0..1000u64 {
        let size = 1 + (i * 37) % 4096;
        let (id, ptr) = a.alloc(size).unwrap();
        assert_eq!(ptr % 256, 0);
        a.write(id, 0, &pattern(id.get(), size as usize)).unwrap();
        ids.push((id, size));
    }
    let s = a.stats().unwrap();
    assert_eq!(s.live_allocations, 1000);
    // Sizes up to 4 KiB fall in 12 classes: one slab (chunk) each, not 1000 chunks.
    assert_eq!(s.small_slabs, 12);
    assert_eq!(s.mapped_bytes, 12 * C);
    for &(id, size) in &ids {
        check(&a, id, size as usize);
        assert_eq!(a.query(id).unwrap().size, size);
    }
    for &(id, _) in &ids {
        a.free(id).unwrap();
    }
    let s = a.stats().unwrap();
    assert_eq!((s.live_allocations, s.live_bytes, s.mapped_bytes, s.small_slabs), (0, 0, 0, 0));
    assert!(matches!(a.free(ids[0].0), Err(Error::UnknownAllocation(_))), "freed small id is stale");
}

#[test]
fn resize_within_class_keeps_address_and_beyond_copies() {
    let a = arena(16);
    let (id, p) = a.alloc(1000).unwrap();
    a.write(id, 0, &pattern(id.get(), 1000)).unwrap();
    assert_eq!(a.resize(id, 1024).unwrap(), p, "same class");
    let moved = Arc::new(Mutex::new(Vec::<MoveEvent>::new()));
    let m = moved.clone();
    a.set_move_callback(Some(Box::new(move |e| m.lock().unwrap().push(*e)))).unwrap();
    let p2 = a.resize(id, 100_000).unwrap();
    assert_ne!(p2, p);
    let mut buf = vec![0u8; 1000];
    a.read(id, 0, &mut buf).unwrap();
    assert_eq!(buf, pattern(id.get(), 1000));
    assert_eq!(a.stats().unwrap().bytes_copied, 1024, "the size was 1024 when it moved");
    // Beyond the small classes: whole chunks, same id.
    let p3 = a.resize(id, 3 * C).unwrap();
    a.read(id, 0, &mut buf).unwrap();
    assert_eq!(buf, pattern(id.get(), 1000));
    assert_eq!(p3 % C, 0);
    assert_eq!(a.query(id).unwrap().size, 3 * C);
    let events = moved.lock().unwrap().clone();
    assert_eq!(events.len(), 2);
    assert_eq!((events[0].old_ptr, events[0].new_ptr), (p, p2));
    assert_eq!((events[1].old_ptr, events[1].new_ptr), (p2, p3));
    assert!(events.iter().all(|e| e.id == id));
    // Grows further in place or by remapping like any chunk allocation.
    a.resize(id, 5 * C).unwrap();
    a.read(id, 0, &mut buf).unwrap();
    assert_eq!(buf, pattern(id.get(), 1000));
    a.free(id).unwrap();
    assert_eq!(a.stats().unwrap().live_allocations, 0);
}

#[test]
fn objects_move_with_their_slab_and_pinning_a_member_pins_the_slab() {
    let a = arena(32);
    // A hole below the slab, so compaction wants to move it down.
    let (big, _) = a.alloc(4 * C).unwrap();
    let objs: Vec<_> = (0..8).map(|_| a.alloc(64 * 1024).unwrap()).collect();
    for &(id, _) in &objs {
        a.write(id, 0, &pattern(id.get(), 4096)).unwrap();
    }
    a.free(big).unwrap();
    let moved = Arc::new(Mutex::new(Vec::<MoveEvent>::new()));
    let m = moved.clone();
    a.set_move_callback(Some(Box::new(move |e| m.lock().unwrap().push(*e)))).unwrap();

    a.pin(objs[3].0).unwrap();
    let r = a.compact().unwrap();
    assert_eq!(r.moved_allocations, 0, "slab pinned through its member");
    a.unpin(objs[3].0).unwrap();
    let r = a.compact().unwrap();
    assert_eq!(r.moved_allocations, objs.len() as u64, "the slab moved, with every object");
    assert_eq!(r.moved_bytes, C, "one chunk remapped");
    let events = moved.lock().unwrap().clone();
    assert_eq!(events.len(), objs.len(), "one event per object");
    for (id, old) in &objs {
        let e = events.iter().find(|e| e.id == *id).expect("event for every object");
        assert_eq!(e.old_ptr, *old);
        assert_eq!(a.query(*id).unwrap().ptr, e.new_ptr);
        check(&a, *id, 4096);
    }
    assert_eq!(a.stats().unwrap().moves, objs.len() as u64);
}

#[test]
fn pinned_small_allocation_cannot_outgrow_its_class() {
    let a = arena(8);
    let (id, _) = a.alloc(300).unwrap();
    a.pin(id).unwrap();
    assert!(matches!(a.resize(id, 10_000), Err(Error::Pinned(_))));
    a.unpin(id).unwrap();
    a.resize(id, 10_000).unwrap();
}

#[test]
fn made_up_ids_are_rejected() {
    let a = arena(8);
    let (id, _) = a.alloc(300).unwrap();
    for raw in [id.get() ^ (1 << 40), (1u64 << 63) | 12345, 1u64 << 63 | 1, id.get() & !(1 << 63)] {
        let fake = vmm_arena::Id::from_raw(raw).unwrap();
        assert!(matches!(a.query(fake), Err(Error::UnknownAllocation(_))), "{raw:#x}");
    }
}

#[test]
fn copy_resized_object_keeps_its_old_address_until_release_retired() {
    let a = arena(8);
    let (x, px) = a.alloc(100).unwrap();
    let _keep = a.alloc(100).unwrap();
    a.write(x, 0, b"old bytes").unwrap();
    assert_ne!(a.resize(x, 5000).unwrap(), px);
    let s = a.stats().unwrap();
    assert_eq!(s.retired_va_bytes, 256, "the old object is retired");
    let (_y, py) = a.alloc(100).unwrap();
    assert_ne!(py, px, "a retired place is not handed out");
    a.release_retired().unwrap();
    assert_eq!(a.stats().unwrap().retired_va_bytes, 0);
    let (_z, pz) = a.alloc(100).unwrap();
    assert_eq!(pz, px, "released: reusable");
}
