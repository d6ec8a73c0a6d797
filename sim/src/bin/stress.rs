//! `stress`: see [`vmm_sim::stress`] for what it does and its options.

fn main() {
    vmm_sim::stress::main()
}
