//! `rlhf_cycle`: see [`vmm_sim::rlhf_cycle`] for what it does and its options.

fn main() {
    vmm_sim::rlhf_cycle::main()
}
