"""The published figures: ``results.json``, ``docs/benchmarks.md`` with its plot, and
the README's headline lines, written from one ``run_all.py`` run's results."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: For a target that compares two figures of its script: (what jaxpod measured, the
#: lower bound or peer measured in the same run).
PAIRS: dict[str, dict[str, tuple[str, str]]] = {
    "engine": {"run_steps_vs_plain_ratio": ("run_steps_ms_per_step", "plain_scan_ms_per_step"),
               "run_vs_bare_jit_ratio": ("run_us_per_call", "bare_jit_us_per_call")},
    "service": {"run_reduce_p50_ms": ("run_reduce_p50_ms", "inprocess_run_reduce_p50_ms"),
                "remote_vs_workers_step_ratio": ("remote_ms_per_step",
                                                 "inside_workers_ms_per_step"),
                "gather_vs_raw_ratio": ("gather_gbps", "raw_grpc_gbps")},
    "checkpoint": {"save_throughput_vs_orbax": ("job_save_s", "plain_save_s"),
                   "stall_vs_d2h": ("job_stall_per_checkpoint_s", "plain_d2h_s"),
                   "restore_vs_orbax": ("job_restore_s", "plain_restore_job_checkpoint_s"),
                   "resume_to_first_step_far_vs_near": ("resume_to_first_step_far_s",
                                                        "resume_to_first_step_near_s")},
    "step_loop": {"loop_remote_vs_inprocess": ("loop_remote_ms_per_step",
                                               "loop_inprocess_ms_per_step"),
                  "trivial_run_reduce_p50_ms": ("trivial_run_reduce_p50_ms",
                                                "inprocess_trivial_run_reduce_p50_ms")},
    "results": {"result_over_bound_largest": ("result_s_largest", "orbax_s_largest")},
    "sharded": {"job_vs_plain": ("job_steps_per_s", "plain_steps_per_s"),
                "job_productive_vs_plain": ("job_productive_steps_per_s", "plain_steps_per_s"),
                "transformer_job_vs_plain": ("transformer_job_steps_per_s",
                                             "transformer_plain_steps_per_s"),
                "transformer_job_productive_vs_plain": ("transformer_job_productive_steps_per_s",
                                                        "transformer_plain_steps_per_s")},
    "dashboard": {"polled_vs_quiet": ("steps_per_s_polled", "steps_per_s_quiet")},
    "job_history": {"last_longest_vs_shortest": ("last_ms_longest", "last_ms_shortest"),
                    "chart_vs_whole_longest": ("chart_ms_longest", "whole_ms_longest")},
}
#: The README lines: (text, script, figure) with ``{}`` for the figure's value.
HEADLINES = (
    ("in-process `run_steps` at {}x a hand-written `lax.scan` on the same devices",
     "engine", "run_steps_vs_plain_ratio"),
    ("job checkpoints saved at {}x the throughput of plain orbax on plain "
     "`jax.distributed`", "checkpoint", "save_throughput_vs_orbax"),
    ("a remote custom training loop at {}x the in-process loop's time per step",
     "step_loop", "loop_remote_vs_inprocess"),
)
SUMMARY_START, SUMMARY_END = "<!-- benchmarks:summary:start -->", "<!-- benchmarks:summary:end -->"
GROWTH_PLOT = "docs/benchmarks/growth.png"
#: The growth figures and their plots' titles.
GROWTH_FIGURES = (
    ("allocation_s", "allocation (s)"), ("run_reduce_p50_ms", "run + reduce p50 (ms)"),
    ("run_steps_vs_workers", "run_steps / inside the workers"),
    ("run_steps_vs_one_process", "run_steps / one-process JAX"),
    ("gather_gbps", "gather GB/s"), ("job_first_step_s", "job submit -> first step (s)"),
    ("recovery_s", "host kill -> resumed step (s)"))


def write_pages(results: dict[str, Any], out: Path, areas: Sequence[Any]) -> list[Path]:
    """Writes every published file under ``out``; the paths written."""
    written = []
    path = out / "benchmarks" / "results.json" if (out / "benchmarks").is_dir() \
        else out / "results.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    written.append(path)
    docs = out / "docs"
    (docs / "benchmarks").mkdir(parents=True, exist_ok=True)
    growth = results["benchmarks"].get("growth", {})
    if "figures" in growth:
        plot_growth(growth["figures"], out / GROWTH_PLOT)
        written.append(out / GROWTH_PLOT)
    page = docs / "benchmarks.md"
    page.write_text(render(results, areas))
    written.append(page)
    readme = out / "README.md"
    if readme.exists():
        readme.write_text(with_summary(readme.read_text(), results))
        written.append(readme)
    return written


# ------------------------------------------------------------------------ the page
def fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(fmt(v) for v in value)
    return str(value)


def headline(results: dict[str, Any], script: str, figure: str) -> str | None:
    entry = results["benchmarks"].get(script, {})
    value = entry.get("targets", {}).get(figure, {}).get("value")
    if value is None:
        value = entry.get("figures", {}).get(figure)
    return None if value is None else fmt(value)


def summary_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    for text, script, figure in HEADLINES:
        value = headline(results, script, figure)
        lines.append(f"* {text.format(value if value is not None else 'n/a')}")
    return lines


def with_summary(readme: str, results: dict[str, Any]) -> str:
    """``readme`` with the lines between the summary markers replaced."""
    pattern = re.compile(re.escape(SUMMARY_START) + ".*?" + re.escape(SUMMARY_END), re.S)
    if not pattern.search(readme):
        return readme
    kind = "quick smoke run" if results["quick"] else "full run"
    block = "\n".join([SUMMARY_START, *summary_lines(results),
                       f"* ({kind} of {results['generated_at']}; every figure, its bound "
                       "and target: [docs/benchmarks.md](docs/benchmarks.md))",
                       SUMMARY_END])
    return pattern.sub(lambda _: block, readme)


def spread_of(entry: dict[str, Any], name: str) -> str:
    """`` [min, max]`` of a figure that varied between the entry's runs, else ``""``."""
    low_high = entry.get("spread", {}).get(name)
    return f" [{fmt(low_high[0])}, {fmt(low_high[1])}]" if low_high else ""


def target_rows(script: str, entry: dict[str, Any]) -> list[str]:
    figures = entry.get("figures", {})
    rows = ["| Target | jaxpod | Lower bound / peer | Value | Target | Met |",
            "|---|---|---|---|---|---|"]
    for name, t in entry.get("targets", {}).items():
        mine, bound = PAIRS.get(script, {}).get(name, (None, None))
        left = (f"{mine} = {fmt(figures[mine])}{spread_of(entry, mine)}"
                if mine in figures else "-")
        right = (f"{bound} = {fmt(figures[bound])}{spread_of(entry, bound)}"
                 if bound in figures else "-")
        met = "**met**" if t["met"] else "**not met**"
        rows.append(f"| `{name}` | {left} | {right} | "
                    f"{fmt(t['value'])}{spread_of(entry, 'target:' + name)} | {t['target']} "
                    f"| {met} |")
    return rows if len(rows) > 2 else []


def figure_rows(entry: dict[str, Any]) -> list[str]:
    rows = ["| Figure | Value |", "|---|---|"]
    rows += [f"| `{k}` | {fmt(v)}{spread_of(entry, k)} |"
             for k, v in entry.get("figures", {}).items()]
    return rows


def area_lines(area: Any, entry: dict[str, Any], notes: dict[str, str]) -> list[str]:
    """One script's section: what it answers, how it ran, its targets and figures."""
    when = f", run {entry['ran_at']}" if "ran_at" in entry else ""
    runs = entry.get("repeats", 1)
    lines = [area.question, "",
             *([getattr(area, "explains", ""), ""] if getattr(area, "explains", "") else []),
             f"`{entry['command']}` ({fmt(entry['seconds'])} s"
             + (f" a run, median of {runs}" if runs > 1 else "") + f"{when})", ""]
    if "error" in entry:
        return [*lines, "**The script failed** (exit "
                f"{entry['exit']}); its last lines:", "", "```", entry["error"], "```", ""]
    if area.script in notes:
        lines += [notes[area.script], ""]
    if area.script == "growth":
        lines += [*growth_section(entry["figures"]), ""]
    rows = target_rows(area.script, entry)
    if rows:
        lines += [*rows, ""]
    return [*lines, "<details><summary>Every figure of this run</summary>", "",
            *figure_rows(entry), "", "</details>", ""]


def rerun_lines(reruns: Sequence[Any], areas: Sequence[Any]) -> list[str]:
    """The ``--only`` runs after the full one, each dated, in a section of its own."""
    dated = [r for r in reruns if isinstance(r, dict)]
    if not dated:
        return []
    lines = ["## Reruns of some scripts", "",
             "Run after the full run above, on their own; their figures are not part of "
             "its tables or its count of targets met.", ""]
    titles = {a.script: a for a in areas}
    for rerun in dated:
        lines += [f"### `{rerun['command']}`, {rerun['generated_at']}", ""]
        for script, entry in rerun["benchmarks"].items():
            area = titles.get(script)
            if area is not None:
                lines += [f"#### {area.title}", "",
                          *area_lines(area, entry, rerun.get("notes", {}))]
    return lines


def growth_section(figures: dict[str, Any]) -> list[str]:
    hosts = figures["hosts"]
    names = [k for k, _ in GROWTH_FIGURES if k in figures]
    rows = ["| Figure | " + " | ".join(f"{h} host(s)" for h in hosts)
            + " | per added host | at 64 hosts | at 256 hosts |",
            "|---|" + "---|" * (len(hosts) + 3)]
    for n in names:
        rows.append(f"| `{n}` | " + " | ".join(fmt(v) for v in figures[n])
                    + f" | {fmt(figures[f'{n}_per_host'])} | "
                    f"{fmt(figures.get(f'{n}_at_64', '-'))} | "
                    f"{fmt(figures.get(f'{n}_at_256', '-'))} |")
    return [
        f"![cost growth with hosts]({GROWTH_PLOT.removeprefix('docs/')})", "",
        *rows, "",
        "What grows, and why. Every simulated host here shares the same "
        f"{figures.get('cores')} cores, so a per-host slope measured here is an upper "
        "bound of what a real host (with its own CPUs) adds:",
        "",
        "* **`run` + `reduce` latency** grows with hosts because the coordinator sends "
        "each operation to every host and waits for all of their answers; the fan-out "
        "is concurrent, so on real hosts the cost per added host is the coordinator's "
        "per-message CPU, not a round trip.",
        "* **Allocation** starts one host worker per host (a Ray actor with JAX) and "
        "configures `jax.distributed` over them; workers start in parallel, so on real "
        "hosts it grows with the slowest host and the coordination service's "
        "registration, not with their sum.",
        "* **`run_steps` against the workers' own time** is what reaching the hosts adds "
        "per call. **Against one-process JAX** on as many devices, the gap is mostly "
        "the cross-process collectives, which run over gloo on loopback here, over ICI "
        "on a TPU slice: on real hardware the one-process bound does not exist for "
        "more than one host.",
        "* **Gather** passes every byte through the coordinator to the client: its "
        "GB/s is bounded by one process's network and copy rate whatever the host "
        "count (results too big for that belong in checkpoints, which the hosts "
        "write themselves).",
        "* **Job first step** and **recovery** include allocation and the first loop's "
        "compile; recovery adds detecting the lost host and restoring the checkpoint, "
        "which every host reads in parallel.",
        "",
        "The 64- and 256-host columns read the least-squares line `a + b * hosts` through "
        "the measured times: an estimate on paper, from this machine's per-host costs "
        "(the ratios and the gather rate have no per-host trend to carry that far).",
    ]


def render(results: dict[str, Any], areas: Sequence[Any]) -> str:
    m = results["machine"]
    kind = ("a quick smoke run (`--quick`: fewer repeats, smaller states; read the "
            "full run's figures for decisions)" if results["quick"] else "a full run")
    all_targets = [(name, t) for name, e in results["benchmarks"].items()
                   for t in e.get("targets", {}).values()]
    met = sum(1 for _, t in all_targets if t["met"])
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by benchmarks/run_all.py from benchmarks/results.json: do not "
        "edit. -->",
        "",
        f"Figures of {kind}, generated {results['generated_at']} by `{results['command']}` "
        f"in {fmt(results.get('seconds'))} s"
        + "".join(f"; then `{c}`" for c in results.get("reruns", []) if isinstance(c, str))
        + f". **{met} of {len(all_targets)} targets met.**",
        "",
        *([f"Each script ran {results['repeats']} times, in rounds; every figure is the "
           "median of its runs, with their [min, max] beside it where they differ, and a "
           "target is judged on the median.", ""] if results.get("repeats", 1) > 1 else []),
        "Figures in seconds, and rates, depend on what else runs on this machine (the "
        "simulated hosts share its cores); ratios of two figures measured in the same "
        "run depend on it less.",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, {m['system']}; "
        f"Python {m['python']}, JAX {m['jax']}, jaxpod {m['jaxpod']}; accelerators: "
        f"{m['accelerators']}. Ratios compare figures measured in the same run, on the "
        "same devices; medians unless a figure says otherwise.",
        "",
        "Headlines:",
        "",
        *summary_lines(results),
        "",
    ]
    for area in areas:
        entry = results["benchmarks"].get(area.script)
        if entry is not None:
            lines += [f"## {area.title}", "",
                      *area_lines(area, entry, results.get("notes", {}))]
    lines += rerun_lines(results.get("reruns", []), areas)
    return "\n".join(lines)


def plot_growth(figures: dict[str, Any], path: Path) -> None:
    """Each growth figure against hosts, with its fitted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    hosts = np.asarray(figures["hosts"], float)
    fig, axes = plt.subplots(2, 4, figsize=(15, 6.5))
    axes.flat[-1].set_visible(False)
    for ax, (name, label) in zip(axes.flat, GROWTH_FIGURES, strict=False):
        if name not in figures:
            ax.set_visible(False)
            continue
        values = np.asarray(figures[name], float)
        slope = figures[f"{name}_per_host"]
        start = float(np.mean(values - slope * hosts))
        ax.plot(hosts, values, "o-", label="measured")
        ax.plot(hosts, start + slope * hosts, "--", color="gray", label="fit a + b*hosts")
        ax.set_title(label)
        ax.set_xlabel("hosts")
        ax.set_xscale("log", base=2)
        ax.set_xticks(hosts, [str(int(h)) for h in hosts])
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle("jaxpod cost growth with simulated hosts (4 chips each, one machine)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
