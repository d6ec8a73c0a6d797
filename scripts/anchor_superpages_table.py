#!/usr/bin/env python3
"""Tables of scripts/anchor_superpages.sh's runs: for each prompt variant,
the arena at every chunk size against vllm-paged (from the 2 MiB run).

Usage: scripts/anchor_superpages_table.py DIR  (default target/anchor)"""
import json
import pathlib
import sys

GIB = 1 << 30


def load(path):
    doc = json.loads(path.read_text())
    return doc["workload"], {m["name"]: m for m in doc["managers"]}


def row(label, m, vllm):
    c = m["driver_calls"]
    calls = c["create"] + c["map"] + c["set_access"] + c["unmap"] + c["release"]
    return (
        f"| {label} | {m['tokens_per_s']:,.0f} | {m['tokens_per_s'] / vllm['tokens_per_s']:.3f} | "
        f"{m['preemptions']:,} | {m['peak_physical_bytes'] / GIB:.2f} | {m['mean_physical_bytes'] / GIB:.2f} | "
        f"{m['mean_live_bytes'] / GIB:.2f} | {m['first_admission_hit_rate'] * 100:.1f} % | "
        f"{m['critical_path_alloc_s']:.1f} | {calls:,} | {m['critical_path_syncs']} | "
        f"{m['ttft_p99_s']:.1f} | {m['tpot_p99_s'] * 1e3:.1f} |"
    )


def main():
    d = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "target/anchor")
    for variant in ["unique", "shared"]:
        base = d / f"{variant}-2mib.json"
        if not base.exists():
            continue
        w, ms = load(base)
        vllm = ms["vllm-paged"]
        print(f"\n**{variant}** — {w['trace']}, {w['capacity_bytes'] / GIB:.0f} GiB KV\n")
        print("| manager | tok/s | vs vLLM | preemptions | peak phys GiB | mean phys GiB | mean live GiB | "
              "first-admission hit | alloc s charged | driver calls | crit syncs | TTFT p99 s | TPOT p99 ms |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        print(row("vllm-paged", vllm, vllm))
        for mib in [2, 4, 8, 16, 20]:
            p = d / f"{variant}-{mib}mib.json"
            if p.exists():
                _, m = load(p)
                print(row(f"arena {mib} MiB", m["arena"], vllm))


main()
