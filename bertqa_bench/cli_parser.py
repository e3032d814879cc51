"""``bertqa-bench``: which inference backend to run a QA model on, how much faster it is, offline
and under load, and whether its answers stay the same. The subcommands:

  bench       every backend of a suite: full-dataset prediction timed, parity judged (make bench-all)
  sweep       bench over a grid of backend x batch size x batching
  loadgen     MLPerf LoadGen scenarios (SingleStream, Server, Offline), each backend the SUT
  bench-ddp   bench with every rank of a torchrun group predicting its share
  parity      the accuracy gate: bench the CPU backends, compare with benchmarks/expected/ (make test)
  train       fine-tune the suite's model (bench trains it when models/ lacks it)
  profile     a PyTorch profile of one backend's timed passes
  report      rebuild a run's summary.md and plots from its results
  score       the official SQuAD (v1.1/v2.0) evaluation of a predictions file
  score-nq    the NQ micro-F1 of a predictions file
  reference   a reference table (results/reference/) from run bundles
  scaling     the multi-GPU scaling table from training and bench records
  track       log finished run bundles to MLflow
  backends    the backend catalogue: what each variant is and whether it can run here
"""
# This module is the parser alone: one subparser per subcommand, a table; each names the
# ``cli.cmd_<name>`` function that runs it.
from __future__ import annotations

import argparse
import textwrap

from . import exit_codes
from .config import PROJECT_ROOT


def _suite_args(p: argparse.ArgumentParser) -> None:
    # default None, read through _suite(): a resume tells a suite the user named from none
    p.add_argument("--suite", default=None, help="suite name in benchmarks/ or a YAML path (default: default)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a suite field, e.g. --set bench.batch_size=16 (repeatable)")


def _model_args(p: argparse.ArgumentParser, where: str = "") -> None:
    """A user's own checkpoint and dev file: bench and bench-ddp take the same three."""
    p.add_argument("--model", metavar="PATH_OR_NAME",
                   help="benchmark this fine-tuned extractive-QA checkpoint as it is, no training: a local folder "
                        "(save_pretrained of model + tokenizer) or a hub name (model.checkpoint)" + where)
    p.add_argument("--allow-pickle", action="store_true",
                   help="accept a checkpoint whose only weights are pytorch_model.bin: they will be UNPICKLED, "
                        "which can run code (safetensors never do)")
    p.add_argument("--dev-file", help="a SQuAD-format (v1.1 or v2.0) dev file to benchmark on "
                                      "(data.source=squad-json, data.dev_file)")


def _output_args(p: argparse.ArgumentParser, progress: bool = True, verdict: bool = False) -> None:
    """Where a run's record goes besides its result bundle (one spelling for every command)."""
    p.add_argument("--no-mlflow", action="store_true",
                   help="write the result bundle only; log it to MLflow later with `bertqa-bench track`")
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no live progress line (logs, CI)")
    if verdict:
        p.add_argument("--no-fail-on-verdict", action="store_true",
                       help="exit 0 on a FAIL or INCONCLUSIVE verdict too (a report, not a gate); a run whose "
                            "reference did not run still exits 3")


def _where() -> str:
    return (f"Outputs: the run's folder results_dir/<run-id>/ (results.csv, summary.md, run.json, predictions/, "
            f"logs/), MLflow in results_dir/mlflow.db, the model under models_dir/<name>/, exported artifacts "
            f"under models_dir/artifacts/, the evaluation-set cache under cache_dir/ (defaults results/, models/, "
            f"cache/). A suite's paths (those, data files) are relative to the project root, {PROJECT_ROOT}; "
            f"file arguments given here (--suite FILE, --model, --dev-file, --resume) to the current directory.")


def _described(summary: str) -> str:
    return "\n\n".join(textwrap.fill(t, 100) for t in (summary, _where()))


def _run_id_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-id", help="name of the run's folder, results_dir/<run-id> (default: "
                                    "<UTC time>-<4 random hex>-<suite>, new for every run); an existing folder is "
                                    "refused unless --resume or --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="with --run-id: empty that run's existing folder first and start the run again")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bertqa-bench", description=_described(__doc__.strip()), epilog=exit_codes.EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="fine-tune the suite's model and save it under models/")
    _suite_args(t)
    _output_args(t, progress=False)
    t.add_argument("--profile-steps", type=int, metavar="N",
                   help="record N optimizer steps half-way through training with torch.profiler (rank 0) and write "
                        "kernels.md (top kernels, step time, GPU idle fraction) under results/profiles/ "
                        "(train.profile_steps)")
    t.set_defaults(fn="train")

    b = sub.add_parser("bench", help="benchmark every backend of a suite (trains the model if missing)",
                       description=_described("Benchmark every backend of a suite (trains the model if missing)."),
                       epilog=exit_codes.EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _suite_args(b)
    b.add_argument("--backends", help="comma-separated backend names (default: the suite's list)")
    _run_id_args(b)
    _model_args(b)
    b.add_argument("--resume", metavar="RUN", help="finish an interrupted or partly failed run (a results/<run-id> "
                                                   "folder or its run id): finished rows are kept, the rest run")
    _output_args(b, verdict=True)
    b.set_defaults(fn="bench")

    bd = sub.add_parser("bench-ddp", help="bench with data-parallel prediction over the ranks torchrun started "
                                          "(one host or several); rank 0 records, the others predict")
    _suite_args(bd)
    bd.add_argument("--backends", help="comma-separated backend names (default: the suite's list)")
    _run_id_args(bd)
    _model_args(bd, where=" (on every host)")
    bd.add_argument("--resume", metavar="RUN", help="finish an interrupted or partly failed run on rank 0's host "
                                                    "(results/<run-id> or its run id; other hosts give the same "
                                                    "--suite/--set): finished rows are kept, the rest run")
    _output_args(bd, verdict=True)
    bd.set_defaults(fn="bench_ddp")

    lgp = sub.add_parser("loadgen", help="MLPerf LoadGen scenarios: each backend as the system under test "
                                         "(SingleStream latency, Server QPS under a latency bound, Offline)")
    _suite_args(lgp)
    lgp.add_argument("--scenario", required=True, choices=["SingleStream", "Server", "Offline"])
    lgp.add_argument("--backends", help="comma-separated backend names (default: the suite's list)")
    lgp.add_argument("--find-peak-qps", action="store_true",
                     help="Server: search the highest target QPS that LoadGen calls VALID")
    _run_id_args(lgp)
    _output_args(lgp, verdict=True)
    lgp.set_defaults(fn="loadgen")

    sw = sub.add_parser("sweep", help="backend x batch size x batching in one run (one MLflow parent), with the best "
                                      "configuration per backend at parity and a throughput plot")
    _suite_args(sw)
    sw.add_argument("--backends", help="comma-separated variants (default: the suite's list, reference excluded)")
    sw.add_argument("--batch-sizes", default="16,32,64,128,256")
    sw.add_argument("--batchings", default="padded", help="comma-separated: padded, trimmed, sorted, packed")
    sw.add_argument("--devices", default="1", help="comma-separated GPU counts for data-parallel prediction, e.g. 1,2,4")
    _run_id_args(sw)
    sw.add_argument("--resume", metavar="RUN", help="finish an interrupted sweep (results/<run-id> or its run id)")
    _output_args(sw, verdict=True)
    sw.set_defaults(fn="sweep")

    r = sub.add_parser("report", help="rebuild summary.md and the plot of a result bundle")
    r.add_argument("run_dir", nargs="?", help="results/<run-id> (default: the latest)")
    r.set_defaults(fn="report")

    pc = sub.add_parser("parity", help="accuracy-parity check against eager FP32; exits 1 on a breach")
    _suite_args(pc)
    pc.add_argument("--backends", help="comma-separated backend names (default: the suite's list)")
    pc.add_argument("--update-expected", action="store_true", help="rewrite the suite's expected-results file")
    _output_args(pc)
    pc.set_defaults(fn="parity")

    s = sub.add_parser("score", help="official SQuAD v1.1 EM/F1, or v2.0 exact/f1/HasAns/NoAns, of a predictions file")
    s.add_argument("dataset")
    s.add_argument("predictions")
    # The official v2.0 script's flags (evaluate-v2.0.py), same names and defaults.
    s.add_argument("--na-prob-file", "-n", help="v2.0: question id -> no-answer probability (the bench writes "
                                                "predictions/<backend>.na_prob.json); adds best_exact/best_f1")
    s.add_argument("--na-prob-thresh", "-t", type=float, default=1.0,
                   help="v2.0: predict no answer where the no-answer probability is above this (default 1.0)")
    s.set_defaults(fn="score")

    sn = sub.add_parser("score-nq", help="Natural Questions long/short P/R/F1 and micro-F1")
    sn.add_argument("gold")
    sn.add_argument("predictions")
    # The official evaluator's flags (nq_eval.py), same names and defaults.
    sn.add_argument("--long_non_null_threshold", type=int, default=2,
                    help="non-null long annotations a gold long answer needs (official default 2)")
    sn.add_argument("--short_non_null_threshold", type=int, default=2,
                    help="non-null short annotations a gold short answer needs (official default 2)")
    sn.set_defaults(fn="score_nq")

    pr = sub.add_parser("profile", help="torch.profiler trace and top-kernels table for one backend")
    _suite_args(pr)
    pr.add_argument("--backend", required=True)
    pr.add_argument("--batches", type=int, default=5)
    pr.add_argument("--top", type=int, default=25)
    pr.add_argument("--clock-mhz", type=float, default=None,
                    help="the SM clock a packed row's kernel floors assume (default the card's boost clock)")
    pr.set_defaults(fn="profile")

    rf = sub.add_parser("reference", help="merge result bundles into a committed reference table (md + csv)")
    rf.add_argument("run_dirs", nargs="+")
    rf.add_argument("--out", required=True, help="output path without extension, e.g. results/reference/h100-bert-base")
    rf.add_argument("--title", required=True)
    rf.add_argument("--notes", help="a markdown file whose text goes under the title")
    rf.set_defaults(fn="reference")

    sc = sub.add_parser("scaling", help="1/2/4-GPU scaling table (md + csv) from training metrics and data-parallel "
                                        "prediction bundles, efficiency within one host and recipe")
    sc.add_argument("sources", nargs="+", metavar="[HOST:]PATH",
                    help="a model folder (its train_metrics.json) or a result bundle; HOST labels the machine")
    sc.add_argument("--out", required=True, help="output path without extension, e.g. results/reference/h100-scaling")
    sc.add_argument("--title", required=True)
    sc.add_argument("--notes", help="a markdown file whose text goes under the title")
    sc.add_argument("--card", help="the GPU, for training metrics saved before they named it")
    sc.add_argument("--date", help="the date, for training metrics saved before they kept it")
    sc.add_argument("--commands-log", help="a log naming each training command (a device run's driver log: 'HH:MM:SS start NAME: COMMAND'), "
                                           "for training metrics saved before they kept their command")
    sc.set_defaults(fn="scaling")

    tr = sub.add_parser("track", help="log result bundles made without MLflow (e.g. on a GPU machine) to MLflow")
    tr.add_argument("run_dirs", nargs="+")
    tr.set_defaults(fn="track")

    lb = sub.add_parser("backends", help="the backend catalogue by device: when to use each and whether it can run "
                                         "here (plug-ins and a suite's own variants too)")
    lb.add_argument("--suite", help="also list the variants this suite declares")
    lb.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    lb.add_argument("--all", action="store_true", help="also list the research variants (benchmarks/experiments.yaml)")
    lb.add_argument("--show", metavar="NAME", help="one variant's every option (catalogue, research or old name)")
    lb.set_defaults(fn="backends")
    return p
