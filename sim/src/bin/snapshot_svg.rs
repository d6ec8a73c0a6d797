//! `snapshot_svg`: see [`vmm_sim::snapshot_svg`] for what it does and its options.

fn main() {
    vmm_sim::snapshot_svg::main()
}
