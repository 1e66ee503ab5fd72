"""The picture of ``vtoken bench serve``: SLO attainment and goodput against the offered request rate.

One PNG with two panels, x = offered rate (req/s, Poisson), one line per variant (``mode`` or
``mode/policy``): left, SLO attainment with the 90 % target as a dashed line and each variant's crossing
(``rate_at_target_interpolated``) marked; right, goodput (requests/s meeting both SLOs). Side effect: writes
``path``.
"""

from __future__ import annotations

from pathlib import Path

from vtoken.bench.served.measures import report_label


def plot_serve(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (att, good) = plt.subplots(1, 2, figsize=(12, 4.6))
    target = report["slo"]["attainment_target"]
    for i, variant in enumerate(report["variants"]):
        runs = sorted(variant["runs"], key=lambda r: r["rate"])
        colour = plt.cm.tab10(i % 10)
        label = report_label(variant)
        rates = [r["rate"] for r in runs]
        att.plot(rates, [r["slo_attainment"] for r in runs], "o-", color=colour, label=label)
        good.plot(rates, [r["goodput_req_s"] for r in runs], "o-", color=colour, label=label)
        crossing = variant.get("rate_at_target_interpolated")
        if crossing is not None:
            att.plot([crossing], [target], "v", color=colour, markersize=9)
    att.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:.0%}")
    att.set_ylim(-0.02, 1.02)
    att.set_ylabel("SLO attainment (share of requests)")
    good.set_ylabel("goodput (req/s meeting both SLOs)")
    slo = report["slo"]
    for ax in (att, good):
        ax.set_xlabel("offered request rate (req/s, Poisson)")
        ax.grid(alpha=0.3)
    att.legend(fontsize=8)
    setup = report["setup"]
    fig.suptitle(
        f"vtoken bench serve: {setup['num_prompts']} requests of {setup['input_len']}+"
        f"{setup['output_len']} tokens, pool {setup['pool_blocks']} blocks, budget {setup['budget']}, "
        f"SLO TTFT ≤ {slo['ttft_ms']:g} ms, TPOT ≤ {slo['tpot_ms']:g} ms",
        fontsize=10,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
