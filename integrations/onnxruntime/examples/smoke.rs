use vmm_arena_onnxruntime::{model, ArenaAllocator, ArenaConfig, Ort, Session, SessionConfig};

fn main() {
    let ort = Ort::global().expect("ort");
    println!("ORT {} at {}", ort.version(), ort.library_path().display());
    let spec = model::ModelSpec::default();
    let path = model::ensure(spec).expect("model");
    let alloc = ArenaAllocator::new(ort, ArenaConfig::default()).expect("alloc");
    let reg = alloc.register().expect("register");
    let base = Session::new(ort, &path, SessionConfig::default()).expect("default session");
    {
        let s = Session::new(ort, &path, SessionConfig { allocator: Some(&reg), ..Default::default() })
            .expect("arena session");
        println!("after create: {:?}", alloc.counters());
        for seq in [1usize, 7, 512] {
            let x = model::input(seq, spec.d_model, 1);
            let a = s.run(&x, seq, spec.d_model).expect("run");
            let b = base.run(&x, seq, spec.d_model).expect("run");
            let same = a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits());
            println!("seq {seq}: same={same} counters={:?}", alloc.counters());
        }
        println!("ort stats: {:?}", alloc.ort_stats());
        println!("session stats: {:?}", vmm_arena_onnxruntime::session_allocator_stats(&s));
        println!("base stats: {:?}", vmm_arena_onnxruntime::session_allocator_stats(&base));
    }
    println!("after drop: {:?} {:?}", alloc.counters(), alloc.arena_stats());
    println!("trim {:?} {:?}", alloc.trim(), alloc.arena_stats());
}
