"""``bertqa-bench``: the command line. One function per subcommand (``cmd_<name>``) takes the
parsed arguments (``cli_parser.build_parser``: the subcommands and their flags) and calls the
pipeline command that does the work (bertqa_bench/commands/, or reporting/ for views of finished
runs); ``main`` maps what went wrong to the documented exit codes."""
from __future__ import annotations

import copy
import json
import os
import shlex
import sys
import traceback
from pathlib import Path

from . import exit_codes
from .reporting.backend_listing import listing, show
from .backends.variants import VariantTable
from .cli_parser import build_parser
from .commands.bench_ddp import Cluster
from .commands.profile import profile_backend
from .commands.sweep import expand
from .config import checkpoint_model_name, resolve_path
from .errors import BenchError, ConfigError
from .measuring.ddp import is_dist_env
from .measuring.interrupt import Interrupted, as_interrupted, interruptible
from .measuring.progress import quiet_library_bars
from .record.results import RunBundle
from .reporting.report import console_summary, latest_run, recommendation, reference_tables, write_report
from .reporting.scaling import commands_from_log, load_rows, write_reference
from .reporting.sweep import sweep_tables, write_sweep_report
from .reporting.tracking import Tracker, default_tracking_uri, import_bundle
from .suite import apply_overrides, load_suite, suite_from_dict
from .tasks import get_task


def _suite(a) -> str:
    return a.suite or "default"


def _positive_ints(text: str, flag: str, example: str) -> list[int]:
    """A comma-separated list of whole numbers >= 1 given to ``flag``, or a one-line error."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if not (x.isdigit() and int(x) >= 1)]
    if bad or not items:
        raise ConfigError(f"{flag} takes whole numbers >= 1, comma-separated (e.g. {example}); got {text!r}")
    return [int(x) for x in items]


def load_resume(target: str, suite: str | None = None, overrides=()):
    """(bundle, config) of the run ``target`` (a results/<run-id> folder or a run id) for
    ``--resume``: the run's own saved config; with --suite/--set, they must describe the same
    config, else the resume is refused with the fields that differ. --set without --suite
    applies to the run's own config (its suite), not to the default suite."""
    from .commands.bench import config_diff

    wanted = load_suite(suite, list(overrides)) if suite else None
    candidates = [Path(target)] + ([wanted.results_root / target] if wanted else []) + [resolve_path("results") / target]
    path = next((c for c in candidates if (c / "run.json").exists()), None)
    if path is None:
        raise BenchError(f"nothing to resume at {target}: no run.json in {', '.join(str(c) for c in candidates)}")
    bundle = RunBundle.load(path)
    saved = bundle.config()
    if not saved:
        raise BenchError(f"{path}: no config.json; this run cannot be resumed")
    cfg = suite_from_dict(saved, str(path / "config.json"))
    if wanted is None and overrides:  # the run's own suite, with the --set values
        wanted = suite_from_dict(apply_overrides(copy.deepcopy(saved), list(overrides)), "--set")
    if wanted is not None:
        diff = config_diff(saved, json.loads(json.dumps(wanted.to_dict(), default=str)))
        if diff:
            raise BenchError(f"cannot resume {bundle.meta.run_id} with another config; it differs in "
                             + "; ".join(diff[:8]) + (f" (+{len(diff) - 8} more)" if len(diff) > 8 else "")
                             + ". Resume without --suite/--set, or start a new run")
    return bundle, cfg


def _backend_list(s: str | None):
    if s is None:
        return None
    names = [b.strip() for b in s.split(",") if b.strip()]
    if not names:  # `--backends ,` or `--backends ''` would quietly run the suite's whole list
        raise ConfigError(f"--backends {s!r} names no backend; give comma-separated names "
                          "(`bertqa-bench backends` lists them)")
    return names


def _threads(cfg) -> None:
    n = cfg.bench.num_threads
    if n:
        import torch

        torch.set_num_threads(n)


def cmd_train(a) -> int:
    from .training.train import train

    extra = [f"train.profile_steps={a.profile_steps}"] if a.profile_steps is not None else []
    cfg = load_suite(_suite(a), a.overrides + extra)
    metrics = train(cfg, tracker=Tracker(cfg.results_root, enabled=not a.no_mlflow), command=_command_line())
    print(json.dumps(metrics, indent=2))
    return 0


def _check_resume_args(a) -> None:
    if a.resume and (a.model or a.dev_file):
        raise BenchError("--resume finishes a run with its own model and data; it takes no --model / --dev-file")


def _bench_config(a, other_host: bool = False):
    """(bundle to resume or None, config) of ``bench``/``bench-ddp``: the run's own with --resume,
    else the suite's with --model/--dev-file. ``other_host``: a bench-ddp rank whose host may lack
    the run's bundle (it lies on rank 0's); then its --suite/--set say what to load, and rank 0
    refuses a model or evaluation set unlike its run's."""
    if not a.resume:
        return None, load_suite(_suite(a), a.overrides + _model_overrides(a))
    _check_resume_args(a)
    try:
        return load_resume(a.resume, a.suite, a.overrides)
    except BenchError as e:
        if not other_host or not str(e).startswith("nothing to resume"):
            raise
        return None, load_suite(_suite(a), a.overrides)


def cmd_bench(a) -> int:
    from .commands.bench import run_bench

    _check_overwrite(a)
    resume, cfg = _bench_config(a)
    _threads(cfg)
    tracker = Tracker(cfg.results_root, enabled=not a.no_mlflow)
    out = run_bench(cfg, backends=_backend_list(a.backends), run_id=a.run_id, tracker=tracker,
                    progress=not a.no_progress, command=_command_line(), resume=resume, overwrite=a.overwrite)
    print()
    print(console_summary(out.bundle))
    print(f"results: {out.run_dir}")
    print(f"verdict: {out.verdict}")
    _timing_line(out.results)
    if out.verdict.status == "INCONCLUSIVE":
        print("INCONCLUSIVE: every parity failure lies within the noise of this many questions; a gate does not "
              "pass it. More dev questions decide it (the table says how many).")
    if tracker.active and tracker.experiment_id:
        print(f"MLflow: {tracker.uri}, experiment bertqa-{cfg.name}; `make mlflow-ui`, then")
        print("\n".join(tracker.links()))
    return _verdict_exit(a, out.verdict)


def _timing_line(results) -> None:
    """Said beside the verdict: rows timed while other processes needed the cores (machine_state.py)."""
    bad = [r for r in results if r.ok and r.timing_reliable is False]
    if bad:
        print(f"timing: unreliable for {len(bad)} of {sum(r.ok for r in results)} rows, timed on a busy machine ("
              + "; ".join(f"{r.backend}: {r.timing_note.removeprefix('unreliable ').strip('()')}" for r in bad[:3])
              + (f"; +{len(bad) - 3} more" if len(bad) > 3 else "") + "): see the table's ⚠")
    noisy = next((r for r in results if r.ok and r.timing_noisy), None)
    if noisy is not None:
        print(f"timing: noisy host: the calibration workload varied {noisy.calibration_cv_pct:.1f}% over the rounds "
              "(see the table's ~); speedups are paired per round, but an interval that straddles 1.0 cannot be "
              "told apart here")


def _verdict_exit(a, verdict) -> int:
    """The documented exit code of a finished run (exit_codes.py), said when it is not 0."""
    code = exit_codes.for_verdict(verdict.status, fail_on_verdict=not getattr(a, "no_fail_on_verdict", False))
    if code:
        why = ("the reference did not run: nothing was judged" if code == exit_codes.NO_REFERENCE
               else f"verdict {verdict.status} (--no-fail-on-verdict exits 0)")
        print(f"exit {code}: {why}", file=sys.stderr)
    return code


def cmd_bench_ddp(a) -> int:
    """``bench`` over the ranks torchrun started (one host or several): every rank predicts its
    share of each backend's plan; rank 0 runs the bench (results, report, MLflow, parity)."""
    from .commands.bench import run_bench

    if not is_dist_env():
        raise BenchError("bench-ddp runs under torchrun (RANK and WORLD_SIZE unset): e.g. `torchrun --standalone "
                         "--nproc-per-node 2 -m bertqa_bench.cli bench-ddp --suite ci`, or `make bench-ddp`")
    _check_resume_args(a)  # refused on every rank before any group forms
    _check_overwrite(a)
    # The group first: a rank that cannot load its config then leaves a formed group (its peers'
    # next collective fails at once) instead of leaving the others waiting to form it.
    cluster = Cluster()
    if cluster.rank != 0:
        try:
            cfg = _bench_config(a, other_host=True)[1]
            _threads(cfg)
            # rank 0's exit code (its verdict's): one rank ending 0 while another ends 1 would
            # hold this host at torchrun's exit barrier
            return cluster.serve(cfg, log=lambda m: print(f"[rank {cluster.rank}] {m}", flush=True))
        finally:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    error, code = "", 0
    try:
        resume, cfg = _bench_config(a)
        _threads(cfg)
        tracker = Tracker(cfg.results_root, enabled=not a.no_mlflow)
        out = run_bench(cfg, backends=_backend_list(a.backends), run_id=a.run_id, tracker=tracker,
                        progress=not a.no_progress, command=_command_line(), cluster=cluster, resume=resume,
                        overwrite=a.overwrite)
        code = exit_codes.for_verdict(out.verdict.status, fail_on_verdict=not a.no_fail_on_verdict)
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        cluster.close(error, code)  # the other ranks stop waiting for work, whatever happened here
    print()
    print(console_summary(out.bundle))
    print(f"results: {out.run_dir}")
    print(f"verdict: {out.verdict}")
    return _verdict_exit(a, out.verdict)


def _model_overrides(a) -> list[str]:
    """``bench --model X [--allow-pickle] [--dev-file F]``: the suite's data and backends, X's model
    as it is (no training), named after X. Values go through JSON, which YAML reads back as the
    same string whatever it looks like."""
    out = []
    model = getattr(a, "model", None)
    if model is not None and not model.strip():
        raise ConfigError("--model is empty; give a checkpoint folder or a hub name")
    if model:
        out += [f"model.checkpoint={json.dumps(a.model)}", f"model.name={json.dumps(checkpoint_model_name(a.model))}",
                "model.random_init=false", "model.timing_only=false", "model.grow_from=null"]
    if getattr(a, "allow_pickle", False):
        out.append("model.allow_pickle=true")
    if getattr(a, "dev_file", None):
        # a command-line path is the user's, relative to where they stand (a suite's data.dev_file
        # is relative to the project root, where the suite lives)
        dev = Path(a.dev_file).expanduser().absolute()
        if not dev.is_file():
            raise BenchError(f"--dev-file {a.dev_file}: no such file ({dev})")
        out += ["data.source=squad-json", f"data.dev_file={json.dumps(str(dev))}"]
    return out


def cmd_loadgen(a) -> int:
    from .commands.loadgen import run_loadgen

    cfg = load_suite(_suite(a), a.overrides)
    _threads(cfg)
    tracker = Tracker(cfg.results_root, enabled=not a.no_mlflow)
    out = run_loadgen(cfg, a.scenario, backends=_backend_list(a.backends), find_peak_qps=a.find_peak_qps,
                      run_id=a.run_id, tracker=tracker, progress=not a.no_progress, command=_command_line(),
                      overwrite=a.overwrite)
    print()
    print(console_summary(out.bundle))
    print(f"results: {out.run_dir}")
    print(f"verdict: {out.verdict}")
    return _verdict_exit(a, out.verdict)


def cmd_sweep(a) -> int:
    from .commands.bench import run_bench

    _check_overwrite(a)
    if a.resume:  # the sweep's variants were added to the saved config; its variant list is the run's
        resume, cfg = load_resume(a.resume, a.suite, a.overrides)
        names = None
    else:
        resume, cfg = None, load_suite(_suite(a), a.overrides)
        names = expand(cfg, _backend_list(a.backends) or [b for b in cfg.bench.backends if b != cfg.bench.reference],
                       _positive_ints(a.batch_sizes, "--batch-sizes", "4,16,64"),
                       [x.strip() for x in a.batchings.split(",") if x.strip()],
                       _positive_ints(a.devices, "--devices", "1,2,4"))
    _threads(cfg)
    tracker = Tracker(cfg.results_root, enabled=not a.no_mlflow)
    out = run_bench(cfg, backends=names, run_id=a.run_id, tracker=tracker, progress=not a.no_progress,
                    command=_command_line(), resume=resume, overwrite=a.overwrite)
    write_sweep_report(out.bundle)
    if tracker.active and tracker.parent_id:  # the sweep's own views beside the bench's, on its parent run
        tracker._try(tracker.artifacts, tracker.parent_id, [out.run_dir / "sweep.md", out.run_dir / "sweep.png"])
    print(sweep_tables(out.bundle))  # the tables, then the recommendation (sweep.md has it first)
    print(recommendation(out.bundle).text())
    print()
    print(f"verdict: {out.verdict}")
    print(f"results: {out.run_dir}")
    if tracker.active and tracker.parent_id:
        print("\n".join(tracker.links()))
    return _verdict_exit(a, out.verdict)


def cmd_report(a) -> int:
    run = Path(a.run_dir) if a.run_dir else latest_run(resolve_path("results"))
    if run is None:
        raise BenchError("no result bundle found; run `make bench-all` first or pass a results/<run-id> folder")
    print(write_report(RunBundle.load(run)))
    return 0


def cmd_parity(a) -> int:
    from .commands.parity_gate import run_parity_check

    cfg = load_suite(_suite(a), a.overrides)
    _threads(cfg)
    ok = run_parity_check(cfg, backends=_backend_list(a.backends), update_expected=a.update_expected,
                          tracker=Tracker(cfg.results_root, enabled=not a.no_mlflow), progress=not a.no_progress,
                          command=_command_line())
    return 0 if ok else 1


def cmd_score(a) -> int:
    # the official v2.0 script's keys for a v2.0 file, printed as it prints them
    out = get_task("squad").score_files(a.dataset, a.predictions, na_prob_file=a.na_prob_file,
                                        na_prob_thresh=a.na_prob_thresh)
    print(json.dumps(out, indent=2) if "HasAns_total" in out or "exact" in out else json.dumps(out))
    return 0


def cmd_score_nq(a) -> int:
    print(json.dumps(get_task("nq").score_files(a.gold, a.predictions, long_non_null_threshold=a.long_non_null_threshold,
                                                short_non_null_threshold=a.short_non_null_threshold), indent=2))
    return 0


def cmd_profile(a) -> int:
    if a.batches < 1 or a.top < 1:
        raise ConfigError(f"--batches and --top must be >= 1, not {a.batches} and {a.top}")
    if a.clock_mhz is not None and not 0 < a.clock_mhz < float("inf"):
        raise ConfigError(f"--clock-mhz must be a positive number of MHz, not {a.clock_mhz}")
    cfg = load_suite(_suite(a), a.overrides)
    _threads(cfg)
    out = profile_backend(cfg, a.backend, n_batches=a.batches, top=a.top, clock_mhz=a.clock_mhz)
    print(out["table"])
    if out["floors"]:
        print((Path(out["dir"]) / "floors.md").read_text())
    print(f"trace: {out['trace']}\ntop kernels: {out['top_csv']}")
    return 0


def cmd_reference(a) -> int:
    notes = Path(a.notes).read_text() if a.notes else ""
    print(reference_tables([Path(d) for d in a.run_dirs], Path(a.out), a.title, notes))
    return 0


def cmd_scaling(a) -> int:
    commands = commands_from_log(Path(a.commands_log).read_text()) if a.commands_log else None
    rows = load_rows(a.sources, card=a.card or "", date=a.date or "", commands=commands)
    notes = Path(a.notes).read_text() if a.notes else ""
    print(write_reference(rows, Path(a.out), a.title, notes))
    return 0


def cmd_track(a) -> int:
    # every bundle read first (its environment too): a damaged one is named before any is logged
    bundles = [RunBundle.load(Path(d)) for d in a.run_dirs]
    for b in bundles:
        b.env()
    for d, b in zip(a.run_dirs, bundles):
        rid = import_bundle(b, resolve_path("results"))
        print(f"{d}: logged as MLflow run {rid} in {default_tracking_uri(resolve_path('results'))}")
    return 0


def cmd_backends(a) -> int:
    if a.suite or a.overrides:  # --set alone applies to the default suite, as everywhere else
        cfg = load_suite(_suite(a), a.overrides)
        table = VariantTable.for_suite(cfg.variants, cfg.bench.device)
    else:
        table = VariantTable.for_suite()
    print(show(table, a.show) if a.show else listing(table, show_all=a.all))
    return 0


def _command_line() -> str:
    args = " ".join(shlex.quote(x) for x in sys.argv[1:])
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # started by torchrun: say so, with its process count
        nodes = int(os.environ.get("WORLD_SIZE", "1")) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return (f"torchrun {f'--nnodes={nodes} ' if nodes > 1 else ''}"
                f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', '?')} -m bertqa_bench.cli {args}")
    return f"bertqa-bench {args}"


def _check_overwrite(a) -> None:
    if getattr(a, "overwrite", False) and getattr(a, "resume", None):
        raise BenchError("--resume finishes a run in its folder; --overwrite empties it to start again: choose one")


def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    args = build_parser().parse_args(argv)
    quiet_library_bars()
    try:
        with interruptible():
            return globals()["cmd_" + args.fn](args)
    except KeyboardInterrupt as e:  # Interrupted (SIGTERM, SIGINT, SIGHUP) or a bare Ctrl-C
        stop = e if isinstance(e, Interrupted) else as_interrupted(e)
        print(f"\n{stop}: stopped (exit {stop.exit_code})", file=sys.stderr)
        return stop.exit_code
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    except (IsADirectoryError, NotADirectoryError) as e:  # a folder given where a file goes, or the reverse
        what = "a folder, where a file was expected" if isinstance(e, IsADirectoryError) else "not a folder"
        print(f"error: {e.filename}: {what}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    except Exception:  # noqa: BLE001 - a bug: its traceback, and a code no verdict uses
        traceback.print_exc()
        print(f"error: internal error in bertqa-bench (exit {exit_codes.INTERNAL_ERROR}); the traceback above "
              "says where", file=sys.stderr)
        return exit_codes.INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
