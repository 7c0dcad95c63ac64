"""The bench's outputs from its JSON dict: a rich table on the terminal and a PNG (tokens/s and speed-up)."""

from __future__ import annotations


def _fmt(value, spec: str = ".1f") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec)


def print_table(result: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    meta = result["meta"]
    label = " [bold red]SYNTHETIC[/]" if result["synthetic"] else ""
    shapes = f" shapes {meta['shapes']}" if meta.get("shapes") else ""
    acc = (f", synthetic acceptance {meta['synthetic_acceptance']}" if meta.get("synthetic_acceptance") is not None
           else "")
    table = Table(title=f"tandem bench{label}: {meta['backend']} on {meta['device_name']} ({meta['device']}), "
                        f"{meta['max_tokens']} tokens{shapes}{acc}")
    for col in ("prompt", "config", "tok/s", "decode tok/s", "speedup", "accept", "a/pos", "mean len", "draft ms/tok",
                "verify ms/it", "pred.", "k counts", "lossless"):
        table.add_column(col, justify="left" if col in ("prompt", "config", "k counts") else "right")
    for p in result["prompts"]:
        for i, (name, c) in enumerate(p["configs"].items()):
            plain = name == "plain"
            table.add_row(
                p["name"] if i == 0 else "", name, _fmt(c["tps"]), _fmt(c.get("decode_tps")),
                _fmt(c["speedup"], ".2f") + "x",
                "" if plain else _fmt(c["acceptance_rate"], ".2f"),
                "" if plain else _fmt(c["first_position_acceptance"], ".2f"),
                _fmt(c["mean_accepted_len"], ".2f"), "" if plain else _fmt(c["draft_ms_per_token"], ".2f"),
                _fmt(c["verify_ms"], ".2f"), "" if plain else _fmt(c["predicted_speedup"], ".2f"),
                "" if plain else " ".join(f"{k}:{n}" for k, n in c["k_counts"].items()),
                "" if plain else _fmt(c["lossless"]),
            )
        for peer, r in p.get("peers", {}).items():
            table.add_row("", f"peer {peer} plain", _fmt(r.get("plain_tps")), "", "", "", "", "", "", "", "", "", "")
            if "assisted_tps" in r:
                table.add_row("", f"peer {peer} assisted", _fmt(r["assisted_tps"]), "", _fmt(r["speedup"], ".2f") + "x",
                              "", "", "", "", "", "", "", _fmt(r.get("lossless")))
        table.add_section()
    console.print(table)
    s = result["summary"]
    console.print(f"summary{label}: plain {s['baseline_tps']:.1f} tok/s, {s['primary']} {s['spec_tps']:.1f} tok/s, "
                  f"geomean speedup {s['speedup']:.2f}x  (tok/s = generated / (prefill + decode), decode tok/s = "
                  f"generated / decode; a/pos = "
                  f"per-position acceptance; pred. = E(k)/(k c_d + V(k+1)) from measured costs)")


def plot(result: dict, path: str) -> None:
    """Two panels per prompt: tokens/s of every config (and peer), and speed-up over tandem plain."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    prompts = result["prompts"]
    names = [p["name"] for p in prompts]
    series: dict[str, list[float]] = {}
    speedups: dict[str, list[float]] = {}
    for p in prompts:
        for config, c in p["configs"].items():
            series.setdefault(config, []).append(c["tps"])
            if config != "plain":
                speedups.setdefault(config, []).append(c["speedup"])
        for peer, r in p.get("peers", {}).items():
            series.setdefault(f"{peer} plain", []).append(r.get("plain_tps", 0.0))
            if "assisted_tps" in r:
                series.setdefault(f"{peer} assisted", []).append(r["assisted_tps"])
                speedups.setdefault(f"{peer} assisted", []).append(r["speedup"])

    fig, (ax_tps, ax_speed) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(names) + 4), 4.5))
    _bars(ax_tps, names, series, "tokens/s")
    _bars(ax_speed, names, speedups, "speed-up over tandem plain")
    ax_speed.axhline(1.0, color="black", linewidth=0.8)
    meta = result["meta"]
    synthetic = "SYNTHETIC — " if result["synthetic"] else ""
    fig.suptitle(f"{synthetic}tandem bench: {meta['backend']} on {meta['device_name']}, {meta['max_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, names: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, values, width, label=label)
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel(ylabel)
    if series:
        ax.legend(fontsize=8)
