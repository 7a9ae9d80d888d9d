"""The doctor's diagnosis and its table, from the measured numbers (no TensorFlow).

:func:`verdict` names the bound (``input-bound``, ``compute-bound`` or
``communication-bound``) with the numbers and what to do; :func:`format_table` prints a
report for a person. :mod:`trainer.doctor` measures.
"""

from __future__ import annotations

from typing import Any, Callable

# The doctor's measurements, in report order (see trainer.doctor).
SECTIONS = ("baseline", "input", "compute", "batch", "jit", "communication", "layers", "plan",
            "threads")

Report = dict[str, Any]


def verdict(report: Report) -> Report:
    """(10) The diagnosis, from the measured numbers.

    The bound is the slower of the two parts, each timed alone: ``input-bound`` when the
    pipeline delivers fewer examples/s than the step consumes (``narrowly`` within 15%),
    else ``communication-bound`` when over 30% of the step is spent across replicas, else
    ``compute-bound``. A run well below both parts also gets advice: host overhead
    between steps and, on CPU, the two parts competing for the same cores.
    """
    run = report["baseline"]["examples_per_s"]
    probe = report["input"]["examples_per_s"]
    # The real run proves the pipeline delivers at least its rate (the probe may be
    # slowed down by other work on a shared machine).
    feed = max(probe, run)
    step = report["compute"]["examples_per_s"]
    comm = report.get("communication") or {}
    if feed == probe:
        pipeline, other = f"{probe:,.0f} ex/s", f"the run gets {run:,.0f}"
    else:
        pipeline, other = f"at least the run's {run:,.0f} ex/s", f"timed alone {probe:,.0f}"
    advice: list[str] = []
    if feed < step:
        kind = "input-bound"
        narrowly = " (narrowly)" if feed >= 0.85 * step else ""
        text = (f"input-bound{narrowly}: the pipeline delivers {pipeline}, fewer than the "
                f"step consumes ({step:,.0f} ex/s; {other}); remedies, in order:")
        advice += input_remedies(report["input"])
    elif comm.get("applicable") and comm["communication_share"] > 0.3:
        kind = "communication-bound"
        text = (f"communication-bound: {comm['replicas']} replicas take "
                f"{comm['n_replica_step_ms']:.2f} ms per step vs {comm['one_replica_step_ms']:.2f} "
                f"ms for one ({comm['communication_share']:.0%} of the step) — raise the "
                f"per-replica batch, accumulate gradients (perf.grad_accum_steps), or pick "
                f"another distribute.all_reduce")
    else:
        kind = "compute-bound"
        text = (f"compute-bound: the step consumes {step:,.0f} ex/s and the pipeline delivers "
                f"{pipeline} ({feed / step:.2f}x the step; {other})")
    if run < 0.8 * min(feed, step):
        advice.append(_overhead_advice(report, run, feed, step))
    advice += _tuning_advice(report, kind)
    return {"kind": kind, "text": text, "advice": advice}


XLA_COMPILES = {"grads": "the forward and backward pass", "step": "the whole step"}


def xla_figure(plan: Report, global_batch_size: int) -> Report:
    """(5) XLA on vs off, from the execution plan's measurement (section (8), :mod:`trainer.loop.plan`):
    of the plans with the configured ``steps_per_loop``, the best XLA setting's score
    (median per-round rate over the configured plan's) divided by the no-XLA plan's. It
    is the plan's own figure: with XLA off configured, the XLA row's "x the configured"
    of section (8)."""
    if not plan.get("applicable"):
        return {"applicable": False, "note": f"not measured: {plan['note']}"}
    if plan["source"] != "measured":
        return {"applicable": False,
                "note": f"the execution plan timed no XLA: {plan.get('reason', plan['source'])}"}
    loop, packs = plan["baseline"]["steps_per_loop"], plan["baseline"].get("pack_bytes", 0)
    rows = [r for r in plan["plans"]
            if r["steps_per_loop"] == loop and r.get("pack_bytes", 0) == packs]
    off = next((r for r in rows if r["xla"] == "off" and r.get("vs_baseline")), None)
    on = [r for r in rows if r["xla"] != "off" and r.get("vs_baseline")]
    if off is None or not on:
        dropped = next((r["dropped"] for r in rows if r["xla"] != "off" and "dropped" in r),
                       "no XLA plan was timed")
        return {"applicable": False, "note": f"the execution plan timed no XLA: {dropped}"}
    best = max(on, key=lambda r: r["vs_baseline"])
    return {"applicable": True, "source": "plan", "setting": best["xla"],
            "steps_per_loop": loop, "configured": plan["baseline"]["xla"],
            "chosen": plan["chosen"],
            "on_examples_per_s": best["steps_per_s"] * global_batch_size,
            "off_examples_per_s": off["steps_per_s"] * global_batch_size,
            "speedup": best["vs_baseline"] / off["vs_baseline"]}


def _xla_advice(jit: Report, plan_mode: str) -> str | None:
    """What to do about XLA, from the one figure of (5) and the plan's choice."""
    speedup, what = jit["speedup"], XLA_COMPILES.get(jit["setting"], jit["setting"])
    if speedup >= 1.15:
        if plan_mode == "auto" and jit["chosen"]["xla"] != "off":
            return (f"XLA ({what} compiled) runs the real run {speedup:.2f}x as fast "
                    f"(sections 5 and 8): perf.plan='auto' (the default) chose it, keep it")
        if jit["setting"] == "grads":
            return None  # configured already: perf.jit_compile=True
        return (f"XLA ({what} compiled) runs the real run {speedup:.2f}x as fast "
                f"(sections 5 and 8): set perf.plan='auto', which measures and keeps it")
    if jit["configured"] != "off" and speedup <= 1 / 1.15:
        return (f"XLA makes the real run slower ({speedup:.2f}x, sections 5 and 8): set "
                f"perf.jit_compile=False")
    return None


def _overhead_advice(report: Report, run: float, feed: float, step: float) -> str:
    """Why a run is well below both its pipeline and its step, each timed alone."""
    text = (f"the run ({run:,.0f} ex/s) is well below both the pipeline ({feed:,.0f} ex/s) "
            f"and the step ({step:,.0f} ex/s), each timed alone: host overhead between "
            f"steps — raise train.steps_per_loop")
    config = report.get("config") or {}
    if config.get("device", "CPU") == "CPU":
        cores = config.get("host_cores")
        text += (f"; on CPU the pipeline and the step also compete for the same "
                 f"{f'{cores} ' if cores else ''}cores when they run together — move "
                 f"preprocessing to other machines (the tf.data service) or cap the "
                 f"pipeline's threads (tf.data.Options().threading.private_threadpool_size)")
    return text


def _plan_rows(plan: Report, row: Callable[..., str]) -> list[str]:
    """(8) The plans the planner timed, the chosen one marked."""
    if not plan.get("applicable"):
        return [row("(8) execution plan", "n/a", plan["note"])]
    if plan["source"] != "measured":
        return [row("(8) execution plan", "not measured", plan.get("reason", plan["source"]))]
    lines = [row("(8) execution plan", "steps/s",
                 f"perf.plan='auto' measured {plan['rounds']} rounds in "
                 f"{plan['measure_s']:.1f} s")]
    for r in plan["plans"]:
        packs = r.get("pack_bytes", 0)
        name = (f"    xla {r['xla']}, steps_per_loop {r['steps_per_loop']}"
                + (f", all-reduce packs of {packs / 2**20:.3g} MiB" if packs else ""))
        chosen = (r["xla"], r["steps_per_loop"], r.get("pack_bytes", 0)) == (
            plan["chosen"]["xla"], plan["chosen"]["steps_per_loop"],
            plan["chosen"].get("pack_bytes", 0))
        if "dropped" in r:
            lines.append(row(name, "-", r["dropped"]))
            continue
        note = (f"{r['vs_baseline']:.2f}x the configured" if r.get("vs_baseline") else "")
        lines.append(row(name, f"{r['steps_per_s']:,.0f}" if r.get("steps_per_s") else "-",
                         note + ("  <- chosen" if chosen else "")))
    return lines


def _thread_rows(threads: Report, row: Callable[..., str]) -> list[str]:
    """(9) The real run under each thread-pool setting, each in its own process."""
    if not threads.get("applicable"):
        return [row("(9) thread pools", "n/a", threads["note"])]
    lines = [row("(9) thread pools (inter/intra)", "examples/s",
                 f"the real run, one process per setting, median of {threads['repeats']}")]
    for r in threads["settings"]:
        name = "    " + "/".join(str(r[p] or "TF") for p in ("inter_op_threads",
                                                            "intra_op_threads"))
        advised = threads["advised"] is not None and r == threads["advised"]
        lines.append(row(name, f"{r['examples_per_s']:,.0f}",
                         f"{r['vs_default']:.2f}x TF's sizing" + ("  <- advised" if advised
                                                                   else "")))
    return lines


def _tuning_advice(report: Report, kind: str) -> list[str]:
    """XLA, a faster batch size and, for a compute-bound run, the costliest layers."""
    advice: list[str] = []
    jit = report.get("jit") or {}
    batch = report.get("batch") or {}
    xla = _xla_advice(jit, (report.get("config") or {}).get("plan", "auto")) if jit.get(
        "applicable") else None
    if xla:
        advice.append(xla)
    pools = (report.get("threads") or {}).get("advised")
    if pools:
        flags = " ".join(f"--config.distribute.{pool}={pools[pool]}"
                         for pool in ("inter_op_threads", "intra_op_threads") if pools[pool])
        advice.append(f"TensorFlow's thread pools: {flags} runs {pools['vs_default']:.2f}x "
                      f"as fast as its own sizing (each setting timed in its own process)")
    fastest = batch.get("fastest")
    # Compared with the configured batch timed in the same search (same conditions).
    configured = next((r for r in batch.get("tried", []) if r.get("examples_per_s")), None)
    if fastest and configured and fastest is not configured and (
            fastest["examples_per_s"] >= 1.3 * configured["examples_per_s"]):
        gain = fastest["examples_per_s"] / configured["examples_per_s"]
        advice.append(f"global batch {fastest['global_batch_size']} runs at "
                      f"{fastest['examples_per_s']:,.0f} ex/s ({gain:.1f}x): "
                      f"raise train.global_batch_size (and scale the learning rate: "
                      f"optimizer.lr_scaling='linear')")
    layers = (report.get("layers") or {}).get("top") or []
    if kind == "compute-bound" and layers:
        names = ", ".join(f"{r['layer']} ({r['forward_ms'] + r['backward_ms']:.2f} ms)"
                          for r in layers[:3])
        advice.append(f"the costliest layers: {names}")
    return advice


SERVICE_COMMAND = ("python -m launch.data_service --port 5050 --workers K  (on machines "
                   "with spare cores; then --config.data.service=HOST:5050 "
                   "--config.train.deterministic=False), or on this machine: "
                   "python -m launch.multiworker --workers N --data_service_workers K ...")


def input_remedies(measured: Report) -> list[str]:
    """What to do about an input-bound run, in the order to try it, led by how the input
    time splits into reading and preprocessing when ``measured`` has ``read_share``.

    File sharding is offered only when ``measured["reads_files"]`` is not False (the
    pipeline reads files through TensorFlow's readers, or that is unknown): an in-memory
    dataset has no files to split. The remedies are numbered without gaps.
    """
    remedies = []
    share = measured.get("read_share")
    if share is not None and measured["read_examples_per_s"] < measured["examples_per_s"]:
        remedies.append(f"reading alone ({measured['read_examples_per_s']:,.0f} ex/s) is slower "
                        f"than the whole pipeline ({measured['examples_per_s']:,.0f} ex/s): the "
                        f"pipeline does not read every example each time (it caches)")
    elif share is not None:
        where = "reading" if share >= 0.5 else "preprocessing"
        remedies.append(f"input time per example: reading {share:.0%}, preprocessing "
                        f"{1 - share:.0%} (reading alone: {measured['read_examples_per_s']:,.0f} "
                        f"ex/s) — {where} dominates")
    steps = [
        "parallelism: num_parallel_calls=tf.data.AUTOTUNE in every map and interleave "
        "(TFDS: ReadConfig(num_parallel_calls_for_interleave_files=AUTOTUNE)), move Python "
        "(py_function) out of the pipeline, batch before cheap per-batch maps",
        "cache: .cache() after decoding (in memory if it fits, else .cache(path)); "
        "augmentation stays after it",
    ]
    reads_files = measured.get("reads_files")
    if reads_files is not False:
        steps.append(f"file sharding{'' if reads_files else ' (if the input reads files)'}: "
                     "with several workers, at least as many files as workers, passed "
                     "through TFDS ReadConfig(input_context=ctx) (models.tfds_data.read_split; "
                     "config.data.sharding='auto'), so each worker reads 1/N of the data")
    steps.append(f"tf.data service: preprocessing in other processes/machines: {SERVICE_COMMAND}")
    return remedies + [f"{n}. {text}" for n, text in enumerate(steps, start=1)]


def format_table(report: Report) -> str:
    """The report as a readable table."""
    c = report["config"]
    lines = [f"Doctor: {c['trainer']}  global batch {c['global_batch_size']} on {c['replicas']} "
             f"replica(s) ({c['strategy']}), {c['precision']}, steps_per_loop "
             f"{c['steps_per_loop']}, {c['steps']} timed steps"
             + (f", time budget {c['time_budget_s']:g} s" if "time_budget_s" in c else ""), ""]
    row = "  {:<34}{:>14}  {}".format
    lines.append(row("measurement", "examples/s", "notes"))
    if "baseline" in report:
        b = report["baseline"]
        lines.append(row("(1) real run", f"{b['examples_per_s']:,.0f}", f"{b['step_ms']:.3f} ms/step"))
    if "input" in report:
        i = report["input"]
        source = {True: ", reads files", False: ", in memory (no files read)"}
        lines.append(row("(2) input pipeline alone", f"{i['examples_per_s']:,.0f}",
                         f"{i['batch_ms']:.3f} ms/batch{source.get(i.get('reads_files'), '')}"))
        if "read_share" in i:
            note = (f"{i['read_share']:.0%} of the input time per example"
                    if i["read_examples_per_s"] >= i["examples_per_s"] else
                    "slower than the whole pipeline: it does not read every example (cache)")
            lines.append(row("    reading alone", f"{i['read_examples_per_s']:,.0f}", note))
    if "compute" in report:
        k = report["compute"]
        lines.append(row("(3) compute alone (cached batch)", f"{k['examples_per_s']:,.0f}",
                         f"{k['step_ms']:.3f} ms/step"))
    if report.get("batch", {}).get("skipped"):
        lines.append(row("(4) batch size search", "n/a", report["batch"]["note"]))
    elif "batch" in report:
        s = report["batch"]
        for r in s["tried"]:
            rate = f"{r['examples_per_s']:,.0f}" if "examples_per_s" in r else "-"
            mem = (f"device peak {r['device_peak_mb']:,.0f} MB" if "device_peak_mb" in r
                   else f"peak RSS {r.get('peak_rss_mb', float('nan')):,.0f} MB")
            lines.append(row(f"(4) global batch {r['global_batch_size']}", rate,
                             f"{'fits' if r['fits'] else 'does NOT fit'}, {mem}"))
        lines.append(row("    largest that fits", str(s["largest_fitting"]), s["stopped"]))
    if "jit" in report:
        j = report["jit"]
        if j["applicable"]:
            lines.append(row(f"(5) XLA on ({j['setting']})", f"{j['on_examples_per_s']:,.0f}",
                             f"{j['speedup']:.2f}x vs off: the median of the per-round "
                             f"ratios of the plan's trials on the real run (section 8), "
                             f"steps_per_loop {j['steps_per_loop']}"))
            lines.append(row("    XLA off", f"{j['off_examples_per_s']:,.0f}", ""))
        else:
            lines.append(row("(5) XLA", "n/a", j["note"]))
    if "plan" in report:
        lines += _plan_rows(report["plan"], row)
    if "threads" in report:
        lines += _thread_rows(report["threads"], row)
    if "communication" in report:
        m = report["communication"]
        if m["applicable"]:
            lines.append(row(f"(6) 1 vs {m['replicas']} replicas", "",
                             f"{m['one_replica_step_ms']:.3f} vs {m['n_replica_step_ms']:.3f} ms/step "
                             f"at per-replica batch {m['per_replica_batch']}: communication "
                             f"(+contention) {m['communication_share']:.0%} of the step"))
        else:
            lines.append(row("(6) communication", "n/a", m["note"]))
    if report.get("layers", {}).get("skipped"):
        lines.append(row("(7) top layers", "n/a", report["layers"]["note"]))
    elif "layers" in report:
        lay = report["layers"]
        lines += ["", f"  (7) top layers (per-replica batch {lay['per_replica_batch']}, each timed alone)",
                  "  {:<24}{:<22}{:>10}{:>10}{:>12}{:>10}{:>12}".format(
                      "layer", "type", "fwd ms", "bwd ms", "params", "param MB", "act MB")]
        for r in lay["top"]:
            lines.append("  {:<24}{:<22}{:>10.3f}{:>10.3f}{:>12,}{:>10.2f}{:>12.2f}".format(
                r["layer"][:23], r["type"][:21], r["forward_ms"], r["backward_ms"], r["params"],
                r["param_mb"], r["activation_mb"]))
        if lay["untimed"]:
            lines.append(f"  not timed: {', '.join(lay['untimed'])}")
    if "verdict" in report:
        v = report["verdict"]
        lines += ["", f"(10) verdict: {v['text']}"] + [f"    - {a}" for a in v["advice"]]
    return "\n".join(lines)
