use vmm_arena::{Arena, ArenaConfig};
const C: u64 = 2 << 20;
#[test]
fn smoke() {
    let a = Arena::new(ArenaConfig { capacity_bytes: 64 * C, reserve_bytes: 16 * C, ..Default::default() }).unwrap();
    let (x, px) = a.alloc(3 * C).unwrap();
    a.write(x, 0, b"hello").unwrap();
    let (y, _py) = a.alloc_growable(C, 4 * C).unwrap();
    let (z, _) = a.alloc(2 * C).unwrap();
    a.write(y, 10, b"yy").unwrap();
    let p2 = a.resize(y, 4 * C).unwrap();
    a.free(x).unwrap();
    let s = a.stats().unwrap();
    println!("{s:?}");
    // force a move: grow y beyond its reservation
    let p3 = a.resize(y, 7 * C).unwrap();
    println!("{px:#x} {p2:#x} {p3:#x}");
    let mut b = [0u8; 2];
    a.read(y, 10, &mut b).unwrap();
    assert_eq!(&b, b"yy");
    let r = a.compact().unwrap();
    println!("{r:?}");
    a.read(y, 10, &mut b).unwrap();
    assert_eq!(&b, b"yy");
    println!("{}", a.snapshot_json().unwrap());
    a.free(z).unwrap();
    a.trim(0).unwrap();
    println!("{:?}", a.stats().unwrap());
}
