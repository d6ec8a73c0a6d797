//! `multi_tenant`: see [`vmm_sim::multi_tenant`] for what it does and its options.

fn main() {
    vmm_sim::multi_tenant::main()
}
