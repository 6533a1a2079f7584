"""bench.busy_host's report: the ratios (kept, over vLLM), the table and the plot."""
from __future__ import annotations

from pathlib import Path


def ratios(results: dict) -> dict:
    """From results[client][target][count] rows: `kept` = tok/s over the same target's at 0
    neighbours, `over_vllm` = each pdserve target's tok/s over vLLM's at the same count; a ratio
    whose numerator or reference is missing (or zero) is left out."""
    def tok(row: dict | None) -> float | None:
        return (row or {}).get("output_tok_s")
    kept: dict = {}
    over_vllm: dict = {}
    for client, targets in results.items():
        for target, levels in targets.items():
            base = tok(levels.get("0"))
            kept.setdefault(client, {})[target] = {n: tok(row) / base for n, row in levels.items()
                                                   if base and tok(row) is not None}
            vllm = targets.get("vllm", {})
            if target != "vllm" and vllm:
                over_vllm.setdefault(client, {})[target] = {n: tok(row) / tok(vllm[n]) for n, row in levels.items()
                                                            if tok(row) is not None and tok(vllm.get(n))}
    return {"kept": kept, "over_vllm": over_vllm}


def fmt(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def format_table(r: dict) -> str:
    wl, m = r["workload"], r["machine"]
    lines = [f"{wl['num_requests']} requests x {wl['num_prompt_tokens']} prompt / {wl['num_output_tokens']} output "
             f"tokens, concurrency {wl['concurrency']}, greedy, EOS ignored, {wl['dtype']}; {m['cpus_usable']} CPUs "
             f"({m['cpu_model']}); log {r['log_dir']}; plot {r['plot']}"]
    for client, targets in r["results"].items():
        lines += ["", f"client {client}", f"{'target':<15}{'nbrs':>5}{'tok/s':>8}{'TTFT ms':>9}{'ITL ms':>8}"
                  f"{'ok/failed':>11}{'kept':>7}{'/vllm':>7}   (latencies: p50)"]
        for target, levels in targets.items():
            for n, row in levels.items():
                kept = r["kept"].get(client, {}).get(target, {}).get(n)
                over = r["over_vllm"].get(client, {}).get(target, {}).get(n)
                lines.append(f"{target:<15}{n:>5}{fmt(row['output_tok_s']):>8}{fmt(row.get('ttft_p50_s'), 1e3, 0):>9}"
                             f"{fmt(row.get('itl_p50_s'), 1e3, 0):>8}{row['num_ok']:>6}/{row['num_failed']!s:<4}"
                             f"{fmt(kept, digits=2):>7}{fmt(over, digits=2):>7}"
                             + (f"   {row['error']}" if row.get("error") else ""))
    lines += [f"{t}: did not start: {srv['error'].splitlines()[0]}" for t, srv in r.get("servers", {}).items()
              if srv.get("error")]
    return "\n".join(lines)


def write_plot(r: dict, path: Path) -> None:
    """Two panels against the number of neighbours, output tok/s and ITL p50 (ms), one line per
    (target, client): a colour per target, a line style per client; missing points are skipped."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = dict(zip(r["results"], ("-", "--", ":")))  # per client, in the run's order
    colours = dict(zip(dict.fromkeys(t for targets in r["results"].values() for t in targets),
                       ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for client, targets in r["results"].items():
        for target, levels in targets.items():
            points = sorted((int(n), row) for n, row in levels.items())
            for ax, key, scale in ((axes[0], "output_tok_s", 1.0), (axes[1], "itl_p50_s", 1e3)):
                xy = [(n, row[key] * scale) for n, row in points if row.get(key) is not None]
                ax.plot([x for x, _ in xy], [y for _, y in xy], styles.get(client, ":"), marker="o",
                        color=colours.get(target), label=f"{target} ({client})")
    for ax, title in zip(axes, ("output tokens/s (higher is better)", "ITL p50, ms (lower is better)")):
        ax.set_title(title)
        ax.set_xlabel("busy neighbour processes")
        ax.set_xticks(sorted(r["neighbours"]))
        ax.set_ylim(bottom=0)  # from zero, so the drop reads as the ratio it is
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Serving beside busy neighbours, {r['machine']['cpus_usable']} CPUs")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
