#!/usr/bin/env python3
"""``make mutation-check``: plant known bugs in a scratch copy of the repository and check that the
tests catch each one (not part of CI: it reruns test files once per bug, ~15 minutes on 2 cores).

Every mutant is one exact text substitution in one source file, with the few test files that
should catch it. The substitution must apply exactly once: when a refactor removes or changes the
target text, the mutant is reported as NOT APPLIED (and the check fails) instead of passing
silently as "killed". A mutant is KILLED when its tests fail (pytest exit status 1), SURVIVED when
they pass; any other outcome (a collection error, no tests selected, a timeout) is an ERROR. First
the selected tests run once on the unmutated copy: they must pass, or no kill means anything.

    python scripts/mutation_check.py             # every mutant
    python scripts/mutation_check.py -k cache    # mutants whose name contains "cache"
    python scripts/mutation_check.py --list

The working tree is copied as it is (tracked files and untracked ones git does not ignore), so
uncommitted changes are checked too; the repository itself is never modified.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple  # pytest arguments: files, node ids, -k expressions
    why: str  # the bug it stands for


M = Mutant
MUTANTS = [
    # --- the layer order: a low module importing a pipeline command (inside a function, where the
    # old cycle test could not see a package-level circle)
    M("upward-import-from-model", "bertqa_bench/model/checkpoint.py",
      "from __future__ import annotations\n",
      "from __future__ import annotations\n\n\ndef _planted():\n    from ..commands.bench import run_bench\n\n    return run_bench\n",
      ("tests/test_architecture.py", "-k", "points_down"),
      "a model module imports a command: the folders no longer show which way a run flows"),
    # --- SQuAD scorer (tests/official_squad.py is the independent reference)
    M("squad-normalize-order", "bertqa_bench/tasks/squad/metrics.py",
      '    s = "".join(ch for ch in s if ch not in _PUNCTUATION)\n    s = _ARTICLES.sub(" ", s)\n',
      '    s = _ARTICLES.sub(" ", s)\n    s = "".join(ch for ch in s if ch not in _PUNCTUATION)\n',
      ("tests/test_metrics.py", "-k", "official"),
      "articles removed before punctuation ('a.b' -> 'b', officially 'ab')"),
    M("squad-articles-inside-words", "bertqa_bench/tasks/squad/metrics.py",
      '_ARTICLES = re.compile(r"\\b(a|an|the)\\b")', '_ARTICLES = re.compile(r"(a|an|the)")',
      ("tests/test_metrics.py", "-k", "official"), "articles removed inside words ('theater' -> 'ter')"),
    M("squad-f1-token-sets", "bertqa_bench/tasks/squad/metrics.py",
      "common = Counter(prediction_tokens) & Counter(ground_truth_tokens)",
      "common = Counter(set(prediction_tokens)) & Counter(set(ground_truth_tokens))",
      ("tests/test_metrics.py", "-k", "official"), "F1 over token sets instead of token counts"),
    M("squad-first-gold-only", "bertqa_bench/tasks/squad/metrics.py",
      "exact_match += metric_max_over_ground_truths(exact_match_score, prediction, golds)",
      "exact_match += metric_max_over_ground_truths(exact_match_score, prediction, golds[:1])",
      ("tests/test_metrics.py", "-k", "official"), "EM against the first gold answer, not the best one"),
    M("squad-score-file-first-gold", "bertqa_bench/tasks/squad/metrics.py",
      "    result: dict = _aggregate(((qid, golds) for qid, golds, _ in ds.questions), predictions,",
      "    result: dict = _aggregate(((qid, golds[:1]) for qid, golds, _ in ds.questions), predictions,",
      ("tests/test_metrics.py", "tests/test_fuzz.py", "-k", "official or strict_reader"),
      "`bertqa-bench score` scores against the first gold answer only"),
    # --- NQ: the task's options reach its metric (tests/official_nq.py is the reference)
    M("nq-task-ignores-thresholds", "bertqa_bench/tasks/nq/task.py",
      "return metrics.nq_evaluate(examples, predictions, long_non_null_threshold=o.long_non_null_threshold,\n"
      "                                   short_non_null_threshold=o.short_non_null_threshold)",
      "return metrics.nq_evaluate(examples, predictions)",
      ("tests/test_nq.py", "-k", "restated"), "NQTask.score ignores the suite's non-null thresholds"),
    M("nq-task-short-threshold-from-long", "bertqa_bench/tasks/nq/task.py",
      "metrics.nq_evaluate(examples, predictions, long_non_null_threshold=o.long_non_null_threshold,\n"
      "                                   short_non_null_threshold=o.short_non_null_threshold)",
      "metrics.nq_evaluate(examples, predictions, long_non_null_threshold=o.long_non_null_threshold,\n"
      "                                   short_non_null_threshold=o.long_non_null_threshold)",
      ("tests/test_nq.py", "-k", "restated"), "the short threshold option wired to the long one"),
    M("nq-gold-rule-strict", "bertqa_bench/tasks/nq/metrics.py",
      "return (sum(a.has_long for a in ex.annotations) >= long_needed,",
      "return (sum(a.has_long for a in ex.annotations) > long_needed,",
      ("tests/test_nq.py", "-k", "restated"), "a gold long answer needs more annotations than the threshold"),
    # --- parity: the compare rule, the verdict, the gate's expected-scores file
    M("parity-agreement-vs-f1-tolerance", "bertqa_bench/record/parity.py",
      "agree_fails = not share >= tolerance.min_agreement", "agree_fails = not share >= tolerance.min_f1_ratio",
      ("tests/test_parity.py",), "answer agreement judged against the F1-ratio tolerance"),
    M("parity-verdict-ignores-parity-failures", "bertqa_bench/record/parity.py",
      'if r.parity == "FAIL" and not getattr(r, "parity_within_noise", False)]',
      'if r.parity == "never" and not getattr(r, "parity_within_noise", False)]',
      ("tests/test_parity.py", "tests/test_parity_noise.py"), "a backend that broke its tolerance does not fail the run"),
    # --- parity's uncertainty (bootstrap intervals, within-noise verdicts)
    M("parity-bootstrap-unpaired", "bertqa_bench/record/parity.py",
      "m_ref, m_out = metrics(ref[idx].sum(axis=1), n), metrics(out[idx].sum(axis=1), n)",
      "m_ref, m_out = metrics(ref[idx].sum(axis=1), n), metrics(out[rng.integers(0, n, size=(b, n))].sum(axis=1), n)",
      ("tests/test_parity_noise.py",), "backend and reference resampled on different questions (not paired)"),
    M("parity-inconclusive-passes", "bertqa_bench/record/parity.py",
      'return Verdict("INCONCLUSIVE", noisy)', 'return Verdict("PASS", noisy)',
      ("tests/test_parity_noise.py",), "a run whose failures are within noise passes the gate"),
    M("parity-noise-any-broken-rule", "bertqa_bench/record/parity.py",
      "all(v[0] for v in deciding.values())", "any(v[0] for v in deciding.values())",
      ("tests/test_parity_noise.py",), "a failure called within noise when only one of its broken rules is"),
    M("contract-shape-unchecked", "bertqa_bench/measuring/runner.py",
      "if tuple(v.shape) != want:", "if False:",
      ("tests/test_contracts.py", "-k", "contract"), "a backend's wrong output shape reaches the scatter"),
    M("gate-drift-one-sided", "bertqa_bench/record/parity.py",
      "if abs(delta) > tolerance_points:", "if delta > tolerance_points:",
      ("tests/test_parity_gate.py",), "a score that dropped past the tolerance passes the gate"),
    M("gate-drift-at-tolerance-fails", "bertqa_bench/record/parity.py",
      "if abs(delta) > tolerance_points:", "if abs(delta) >= tolerance_points:",
      ("tests/test_parity_gate.py",), "a drift of exactly the tolerance fails"),
    M("gate-tolerance-off-by-one-question", "bertqa_bench/commands/parity_gate.py",
      "return 100.0 * q / evalset.n_questions if q is not None",
      "return 100.0 * (q + 1) / evalset.n_questions if q is not None",
      ("tests/test_parity_gate.py",), "questions -> points conversion one question too loose"),
    M("gate-update-expected-rounds", "bertqa_bench/commands/parity_gate.py",
      "**{m: r.scores.get(m) for m in task.metric_names}}",
      "**{m: round(r.scores.get(m), 1) for m in task.metric_names}}",
      ("tests/test_parity_gate.py",), "--update-expected writes rounded scores, not the run's"),
    # --- batch plans and the scatter back to dataset order
    M("scatter-narrow-rows-sorted", "bertqa_bench/record/schedule.py",
      "dst[batch.rows, : o.shape[1]] = o[:k]", "dst[np.sort(batch.rows), : o.shape[1]] = o[:k]",
      ("tests/test_runner.py", "-k", "packed or dataset_order"),
      "a length-sorted batch's outputs written in index order, not the batch's row order"),
    M("head-first-pads-with-zeros", "bertqa_bench/backends/transforms/packed_encoder.py",
      "seq = self._head_pad(x.dtype).expand(b * s, -1).clone()", "seq = x.new_zeros(b * s, x.shape[1])",
      ("tests/test_backends.py", "-k", "head_first"),
      "with the head before the scatter, padding positions get 0 instead of the head of a zero hidden state"),
    M("head-first-refusal-is-a-failure", "bertqa_bench/backends/torch_builder.py",
      "        why = head_first_reason(module.model)\n", "        why = None\n",
      ("tests/test_backends.py", "-k", "head_first"),
      "an NQ model under head_first fails its row with a ValueError instead of being not run, named"),
    M("head-first-head-runs-twice", "bertqa_bench/backends/transforms/packed_encoder.py",
      "        setattr(model, TOKEN_HEAD, nn.Identity())\n", "",
      ("tests/test_backends.py", "-k", "head_first"),
      "the task model's own head stays and runs again on the head's logits"),
    M("packed-batch-too-narrow", "bertqa_bench/record/schedule.py",
      "_round_up(lengths[chunk].max(), 8)", "_round_up(lengths[chunk].min(), 8)",
      ("tests/test_runner.py", "-k", "packed"), "a packed batch cut to its shortest row"),
    M("padding-reaches-postprocessing", "bertqa_bench/record/schedule.py",
      "            o[pad[:, : o.shape[1]]] = PAD_LOGIT", "            pass",
      ("tests/test_runner.py", "-k", "packed or padding"), "padding logits are left for postprocessing"),
    M("timed-passes-either-minimum", "bertqa_bench/measuring/runner.py",
      "while len(timer.pass_s) < min_passes or clock() - started < min_duration_s:",
      "while len(timer.pass_s) < min_passes and clock() - started < min_duration_s:",
      ("tests/test_runner.py", "-k", "timed_passes"), "timing stops once either minimum is met"),
    M("outputs-in-reused-memory-pass", "bertqa_bench/measuring/runner.py",
      "if k in earlier and np.shares_memory(earlier[k], v):", "if k in earlier and False:",
      ("tests/test_contracts.py", "-k", "reused"), "a backend that writes each batch into the previous batch's arrays passes"),
    # --- interleaved rounds: the pairing, the order, the recommendation's floor
    # --- rows of several processes, their interval, the stopping rule, the noise sensors (issue 60)
    M("rounds-one-process-only", "bertqa_bench/measuring/rounds.py",
      "        i = round_index % len(self.sessions)\n", "        i = 0\n",
      ("tests/test_rounds.py", "-k", "two_processes"), "a row's second process never takes a turn"),
    M("rounds-interval-ignores-processes", "bertqa_bench/record/rounds.py",
      "log_mean_variance(logs, [g for _, g in kept], pooled_between)", "log_mean_variance(logs, None)",
      ("tests/test_noise_sensors.py", "-k", "offsets or rerun"),
      "the interval ignores the spread between worker processes (a rerun lands outside it)"),
    M("rounds-rerun-spread-ignored", "bertqa_bench/record/rounds.py",
      "    total = var_mean + spread\n", "    total = var_mean\n",
      ("tests/test_noise_sensors.py", "-k", "rerun_spread or whole_run"),
      "bench.rerun_spread_pct is accepted and left out of the interval (a run that shifts as a whole lands outside)"),
    M("rounds-rerun-spread-not-passed", "bertqa_bench/measuring/rounds.py",
      "spread = 0.0 if within_run or name == self.reference else self.rerun_spread_pct", "spread = 0.0",
      ("tests/test_rounds.py", "-k", "rerun_spread"),
      "the bench reports intervals without the configured between-run spread"),
    M("rounds-pooled-spread-ignored", "bertqa_bench/measuring/rounds.py",
      "pooled = self.pooled_between() if self.pool_process_spread and name != self.reference else None",
      "pooled = None",
      ("tests/test_rounds.py", "-k", "pooled"),
      "bench.pool_process_spread is accepted and each row keeps its own one-degree-of-freedom process spread"),
    M("rounds-pool-truncates-per-row", "bertqa_bench/record/rounds.py",
      "    return max(0.0, sum((a.m - 1) * a.between_component for a in rows) / df), float(df)\n",
      "    return sum((a.m - 1) * max(0.0, a.between_component) for a in rows) / df, float(df)\n",
      ("tests/test_noise_sensors.py", "-k", "pooled"),
      "each row's negative estimate is cut to zero before pooling, biasing the pooled spread upwards"),
    M("rounds-second-process-not-started", "bertqa_bench/commands/bench_rows.py",
      "        for i in range(2, wanted + 1):\n", "        for i in range(2, 2):\n",
      ("tests/test_e2e.py", "-k", "end_to_end_cpu"), "every row runs in one process whatever bench.processes says"),
    M("merge-drops-second-process", "bertqa_bench/measuring/sessions.py",
      'pass_s = [p for r in records for p in r["pass_s"]]', 'pass_s = list(first["pass_s"])',
      ("tests/test_noise_sensors.py", "-k", "one_record"), "a row's time from its first process's passes only"),
    M("rounds-stop-when-narrow", "bertqa_bench/measuring/rounds.py",
      "    if rec.planned_rounds is not None and n >= rec.planned_rounds:\n",
      "    if n > settings.min_rounds and rec.reference in alive and all((rec.speedup(x).halfwidth_pct or 1e9)\n"
      "                                                                 <= settings.target_halfwidth_pct\n"
      "                                                                 for x in alive if x != rec.reference):\n"
      "        return \"every interval within the target\"\n"
      "    if rec.planned_rounds is not None and n >= rec.planned_rounds:\n",
      ("tests/test_rounds.py", "-k", "fix_how_many"),
      "the rounds stop as soon as the intervals look narrow (stopping on the data narrows them)"),
    M("rounds-not-planned", "bertqa_bench/measuring/rounds.py",
      "        if rec.n_rounds == _pilot(alive, settings) and rec.planned_rounds is None:\n",
      "        if False:\n",
      ("tests/test_rounds.py", "-k", "fix_how_many or spread_wider"),
      "the number of rounds is never fixed from the first ones"),
    M("gpu-sensor-ignores-contention", "bertqa_bench/record/noise.py",
      "if self.jitter_pct is not None and self.jitter_pct > threshold_pct:",
      "if self.jitter_pct is not None and self.jitter_pct > 1e9:",
      ("tests/test_noise_sensors.py", "-k", "time_sliced"),
      "another process time-sliced on the GPU through every round is not seen (the rounds agree)"),
    M("gpu-noise-marks-cpu-rows", "bertqa_bench/record/noise.py",
      '    if device == "cuda" and gpu is not None:\n', "    if gpu is not None:\n",
      ("tests/test_noise_sensors.py", "-k", "only_gpu_rows"), "a noisy GPU reading marks CPU rows too"),
    M("host-noise-unscaled-on-gpu", "bertqa_bench/record/noise.py",
      "        felt = share * calibration_cv_pct\n", "        felt = calibration_cv_pct\n",
      ("tests/test_noise_sensors.py", "-k", "host_bound"),
      "a noisy host marks every GPU row, however little of its passes the host works in"),
    M("gpu-clock-one-sample", "bertqa_bench/record/noise.py",
      'out = {"gpu_sm_clock_mhz": med(0),', 'out = {"gpu_sm_clock_mhz": samples[-1][0],',
      ("tests/test_noise_sensors.py", "-k", "clock_under_load"),
      "the GPU clock read once, after the passes (1,980 MHz on a card power-capped at 1,650)"),
    M("gpu-sampler-keeps-idle-wait", "bertqa_bench/measuring/gpu_sensor.py",
      "            del self.samples[self._kept:]\n", "            pass\n",
      ("tests/test_noise_sensors.py", "-k", "sampler"),
      "a GPU row's clock counts the idle wait for its first turn (the card at 1,980 MHz, not its 1,650 under load)"),
    M("rounds-ratio-unpaired", "bertqa_bench/record/rounds.py",
      "for a, b in zip(ref_s, row_s) if", "for a, b in zip(ref_s, list(row_s)[1:] + list(row_s)[:1]) if",
      ("tests/test_rounds.py",), "a row's pass divided into the reference's pass of another round (drift not cancelled)"),
    M("rounds-order-fixed", "bertqa_bench/record/rounds.py",
      "return [(k + i) % n_rows for i in range(n_rows)]", "return list(range(n_rows))",
      ("tests/test_rounds.py", "-k", "order"), "every round times the rows in the same order"),
    M("recommend-row-not-decidedly-faster", "bertqa_bench/reporting/recommend.py",
      "return r.speedup_low is not None and r.speedup_low > 1.0", "return r.speedup is not None and r.speedup > 1.0",
      ("tests/test_rounds.py", "-k", "recommend"), "a row whose interval reaches 1.0 is recommended over the reference"),
    # --- the LoadGen Server batcher
    M("server-ladder-ignores-budget", "bertqa_bench/measuring/loadgen_sut.py",
      "cap = self.buckets[-1] if fit >= self.buckets[-1] else max(1, fit // 8 * 8 if fit >= 8 else fit)",
      "cap = self.buckets[-1]",
      ("tests/test_loadgen.py", "-k", "ladder or server_batch or plain_rule"),
      "a Server batch of long features is padded past the token budget"),
    M("server-take-longer-first", "bertqa_bench/measuring/loadgen_sut.py",
      "np.lexsort((np.arange(len(p)), seq_a > anchor, np.abs(seq_a - anchor)))",
      "np.lexsort((np.arange(len(p)), seq_a < anchor, np.abs(seq_a - anchor)))",
      ("tests/test_loadgen.py", "-k", "ladder or server_batch or plain_rule"),
      "the batcher takes a longer neighbour (padding every row) before an equally near shorter one"),
    M("offline-gathers-the-batch-after", "bertqa_bench/measuring/loadgen_sut.py",
      "current, ahead = ahead, (gather(k + 1) if k + 1 < len(plan.batches) else None)",
      "current, ahead = (gather(k + 1) if k + 1 < len(plan.batches) else ahead), None",
      ("tests/test_loadgen.py", "-k", "gathers_each_batch"),
      "Offline's look-ahead hands predict the next batch's inputs instead of this one's"),
    M("encode-batch-mask-by-one", "bertqa_bench/measuring/loadgen_sut.py",
      "np.arange(a.shape[1])[None, :] < np.asarray(lengths)[:, None]",
      "np.arange(a.shape[1])[None, :] <= np.asarray(lengths)[:, None]",
      ("tests/test_loadgen.py", "-k", "encoded_at_once or gathers_each_batch"),
      "a batch's answers carry one padding logit each (the accuracy log would misalign)"),
    # --- training: regional compilation and the scaling table
    M("compile-blocks-first-only", "bertqa_bench/training/steps.py",
      "    for _, block in blocks:\n        block.compile(dynamic=dynamic, **options)\n    return [n for n, _ in blocks]",
      "    for _, block in blocks[:1]:\n        block.compile(dynamic=dynamic, **options)\n    return [n for n, _ in blocks]",
      ("tests/test_train_speed.py", "-k", "regionally or repeated_blocks"),
      "only the first layer is compiled while every layer is reported compiled"),
    M("scaling-last-epoch-is-the-first", "bertqa_bench/reporting/scaling.py",
      "/ len(epochs) / float(epochs[-1])", "/ len(epochs) / float(epochs[0])",
      ("tests/test_scaling.py",), "the last epoch's rate is taken over the first (compiling) epoch"),
    # --- the evaluation-set cache key
    M("cache-key-tokenizer-by-name", "bertqa_bench/data/evalset.py",
      '"tokenizer": _tokenizer_fingerprint(tokenizer_source)', '"tokenizer": tokenizer_source',
      ("tests/test_evalset.py",), "a changed tokenizer file in the same folder reuses stale features"),
    M("cache-key-some-tokenizer-files", "bertqa_bench/data/evalset.py",
      'names = _FIRST_KEY_FILES + tuple(n for n in TOKENIZER_FILES if n not in _FIRST_KEY_FILES)',
      'names = ("tokenizer_config.json",)',
      ("tests/test_evalset.py",), "only one tokenizer file is part of the key"),
    M("cache-key-no-doc-stride", "bertqa_bench/data/evalset.py",
      '"doc_stride": d.doc_stride, ', "",
      ("tests/test_evalset.py",), "a changed doc_stride reuses windows of the old stride"),
    M("cache-key-data-by-path", "bertqa_bench/tasks/base.py",
      "parts += [file_fingerprint(f) for f in files] if files else [d.hf_name]",
      "parts += [str(f) for f in files] if files else [d.hf_name]",
      ("tests/test_evalset.py",), "an edited data file at the same path reuses stale features"),
    M("cache-key-no-featurizer-version", "bertqa_bench/tasks/base.py",
      "parts = [self.name, split, d.source, FEATURIZER_VERSION]", "parts = [self.name, split, d.source]",
      ("tests/test_evalset.py",), "a new featurizer reuses features of the old one"),
    # --- a variant's options reach the model: FP8 keep_layers
    M("fp8-backend-quantizes-kept-layers", "bertqa_bench/backends/torch_builder.py",
      "done = swap(module, keep)", "done = swap(module, [])",
      ("tests/test_fp8.py", "-k", "kept_layers_stay or sensitivity"),
      "the backend quantizes every layer while prepare_info reports the kept ones"),
    M("fp8-swap-quantizes-kept-linears", "bertqa_bench/backends/transforms/fp8_surgery.py",
      "    done: set[str] = set(kept)\n", "    done: set[str] = set()\n",
      ("tests/test_fp8.py", "-k", "kept_layers_stay"), "a kept layer's Linears are swapped anyway"),
    M("fp8-swap-fuses-kept-attention", "bertqa_bench/backends/transforms/fp8_surgery.py",
      "            if layer_index(attn_name) in keep or any(", "            if any(",
      ("tests/test_fp8.py", "-k", "kept_layers_stay"), "a kept layer's attention is fused into FP8 anyway"),
    # --- FP8 with e4m3 FFN hidden activations, and the tanh GELU kernel
    M("fp8-out-scale-multiplies", "bertqa_bench/backends/transforms/fp8_modules.py",
      "float(act_scale) / float(out_scale), dtype=torch.float32", "float(act_scale) * float(out_scale), dtype=torch.float32",
      ("tests/test_fp8.py", "-k", "output_scale or ffn"), "the FP8-output GEMM scales its result the wrong way"),
    M("fp8-out-bias-not-scaled", "bertqa_bench/backends/transforms/fp8_modules.py",
      "b = None if b is None else b.float() / float(out_scale)", "b = None if b is None else b.float()",
      ("tests/test_fp8.py", "-k", "output_scale or ffn"), "the bias of an FP8-output GEMM is added unscaled"),
    M("fp8-intermediate-skips-down-scale", "bertqa_bench/backends/transforms/fp8_modules.py",
      "return saturate_to_e4m3(h, self._inv_down_scale)",
      "return saturate_to_e4m3(h)",
      ("tests/test_fp8.py", "-k", "ffn"), "GELU's e4m3 output is not in the down-projection's input scale"),
    M("gelu-kernel-drops-the-cubic", "bertqa_bench/kernels/gelu_fp8.py",
      "u = 0.7978845608028654 * (h + 0.044715 * h * h * h)", "u = 0.7978845608028654 * h",
      ("tests/test_fp8.py", "-k", "interpreter"), "the Triton kernel computes another function than the torch one"),
    M("gelu-kernel-without-the-hardware-tanh", "bertqa_bench/kernels/gelu_fp8.py",
      "        if FAST_TANH:  # the SFU's tanh", "        if False:  # the SFU's tanh",
      ("tests/test_fp8.py", "-k", "hopper"), "the GPU kernel computes tanh through exp, the slow way"),
    M("gelu-kernel-masks-nothing", "bertqa_bench/kernels/gelu_fp8.py",
      "tl.store(y_ptr + offs, g.to(y_ptr.dtype.element_ty), mask=mask)",
      "tl.store(y_ptr + offs, g.to(y_ptr.dtype.element_ty), mask=offs < n - 1)",
      ("tests/test_fp8.py", "-k", "interpreter"), "the kernel leaves the last element unwritten"),
    M("gelu-kernel-keeps-inductors-fp64-scales", "bertqa_bench/kernels/gelu_fp8.py",
      "        s_in = tl.cast(in_scale, tl.float32)\n", "        s_in = in_scale\n",
      ("tests/test_fp8.py", "-k", "hopper"), "under Inductor the kernel's math runs in fp64 (it failed to lower)"),
    M("gelu-epilogue-formula-skips-the-saturation", "bertqa_bench/kernels/cublaslt_epilogues.py",
      "return (gelu_tanh(y) * out_inv_scale.float()).clamp(-E4M3_MAX, E4M3_MAX)",
      "return gelu_tanh(y) * out_inv_scale.float()",
      ("tests/test_fp8.py", "-k", "epilogue_formula"), "past +-448 the epilogue's formula writes NaN, not +-448"),
    M("ffn-epilogue-adds-the-output-scaled-bias", "bertqa_bench/backends/transforms/fp8_modules.py",
      "bias_for_epilogue(dense.bias_unscaled,", "bias_for_epilogue(dense.bias,",
      ("tests/test_fp8.py", "-k", "ffn_epilogue_path"),
      "the epilogue adds the bias already divided by the up-projection's output scale"),
    M("gelu-epilogue-drops-the-fast-accumulation", "bertqa_bench/backends/transforms/fp8_modules.py",
      "self.down_inv_scale,\n                                d.fast_accum, d.cublaslt_autotune, d.cublaslt_candidates)",
      "self.down_inv_scale,\n                                False, d.cublaslt_autotune, d.cublaslt_candidates)",
      ("tests/test_fp8.py", "-k", "ffn_epilogue_path"),
      "the epilogue GEMM promotes to fp32 where the GEMM it replaces accumulates fast: as slow as the two kernels"),
    M("residual-gemm-leaves-the-residual-out", "bertqa_bench/kernels/cublaslt_epilogues.py",
      "    y = (x8.float() @ w8.float().t()) * (x_scale.float() * w_scale.float()) + residual.float()\n",
      "    y = (x8.float() @ w8.float().t()) * (x_scale.float() * w_scale.float())\n",
      ("tests/test_fp8.py", "-k", "residual_in_gemm_calls"),
      "the GEMM that takes over the residual add forgets it: every layer loses its skip connection"),
    M("cublaslt-autotune-not-handed-to-the-gemms", "bertqa_bench/backends/transforms/fp8_surgery.py",
      "        lin.cublaslt_autotune, lin.cublaslt_candidates = int(cublaslt_autotune), int(cublaslt_candidates)\n",
      "        lin.cublaslt_autotune, lin.cublaslt_candidates = 0, int(cublaslt_candidates)\n",
      ("tests/test_fp8.py", "-k", "cublaslt_gemms_run_the_planned_op"),
      "cublaslt_autotune is accepted and every GEMM still runs the heuristic's algorithm: the row measures nothing new"),
    M("cublaslt-candidates-not-handed-to-the-gemms", "bertqa_bench/backends/transforms/fp8_surgery.py",
      "        lin.cublaslt_autotune, lin.cublaslt_candidates = int(cublaslt_autotune), int(cublaslt_candidates)\n",
      "        lin.cublaslt_autotune, lin.cublaslt_candidates = int(cublaslt_autotune), 0\n",
      ("tests/test_fp8.py", "-k", "cublaslt_gemms_run_the_planned_op"),
      "fp8.cublaslt_candidates is accepted and autotuning still times nvmath's default 8 algorithms"),
    M("cublaslt-gemms-left-on-scaled-mm", "bertqa_bench/backends/transforms/fp8_surgery.py",
      "        if kind in kinds:\n            lin.use_cublaslt(cublaslt_autotune)\n",
      "        if False:\n            lin.use_cublaslt(cublaslt_autotune)\n",
      ("tests/test_fp8.py", "-k", "cublaslt_gemms_run_the_planned_op"),
      "the GEMMs named in cublaslt_gemms stay on torch._scaled_mm, where no autotuned algorithm reaches them"),
    M("autotune-times-the-warm-up-dummies", "bertqa_bench/kernels/cublaslt_epilogues.py",
      '            mm.reset_operands(**{k: _random_like(operands[k]) for k in ("b", "c") if k in operands}, stream=stream)\n',
      "",
      ("tests/test_fp8.py", "-k", "planned_gemm_autotunes_once"),
      "cuBLASLt's algorithms are timed on the packed warm-up's dummy tokens, one repeated row, not on varied bits"),
    M("token-buckets-pad-for-one-token-dummies-anyway", "bertqa_bench/backends/transforms/packed_encoder.py",
      "        size = _round_up(t if self.empty_dummies else t + self.cu_len - 1 - rows, self.bucket)",
      "        size = _round_up(t + self.cu_len - 1 - rows, self.bucket)",
      ("tests/test_backends.py", "-k", "empty_dummies_keep_a_batch"),
      "a packed batch filled to whole buckets still takes the next bucket for its dummies' tokens (3 % of its "
      "tokens computed for nothing at 32k)"),
    M("every-packed-attention-takes-empty-sequences", "bertqa_bench/backends/transforms/packed_encoder.py",
      '        return self.attention == "triton"\n', "        return True\n",
      ("tests/test_backends.py", "-k", "empty_dummy_sequences_leave"),
      "FlashAttention's and cuDNN's kernels, untested on empty sequences, get them"),
    M("cublaslt-plan-keeps-every-candidate", "bertqa_bench/kernels/cublaslt_epilogues.py",
      "        return make(stream, mm.algorithms[:1])", "        return make(stream, mm.algorithms)",
      ("tests/test_fp8.py", "-k", "planned_gemm_autotunes_once"),
      "each shape's plan keeps every candidate algorithm and the largest workspace any of them needs (the "
      "suspected cause of 25,784 MiB a process at 64k-token batches)"),
    M("cublaslt-plan-keeps-its-operands", "bertqa_bench/kernels/cublaslt_epilogues.py",
      "    mm.release_operands()\n", "",
      ("tests/test_fp8.py", "-k", "keeps_no_reference_to_the_activations"),
      "every token bucket's plan keeps its last activations allocated in the CUDA graph pool (~6 KB a token "
      "of every bucket and copy: 7.5 GiB a process at 32k tokens, 25.8 GiB at 64k)"),
    M("graph-copies-share-one-cublaslt-plan", "bertqa_bench/kernels/cublaslt_epilogues.py",
      "    key = (*key, _COPY.get())\n", "    key = (*key, 0)\n",
      ("tests/test_fp8.py", "-k", "each_graph_copy_plans_its_own"),
      "graph copies replaying at once on two streams write into one cuBLASLt workspace"),
    M("graph-copies-autotune-apart", "bertqa_bench/kernels/cublaslt_epilogues.py",
      "            first = _PLANS.get((*key[:-1], 0)) if key[-1] else None\n", "            first = None\n",
      ("tests/test_fp8.py", "-k", "each_graph_copy_plans_its_own"),
      "each graph copy autotunes on its own, so a batch's bits depend on the stream it lands on"),
    M("streams-all-replay-copy-0", "bertqa_bench/backends/torch_backend.py",
      "            copy = slot % len(self._streams)\n", "            copy = 0\n",
      ("tests/test_fp8.py", "-k", "slot_k_to_stream"),
      "every stream replays graph copy 0: batches in flight on two streams write one copy's buffers at once"),
    M("graph-copies-captured-on-one-stream", "bertqa_bench/backends/device_io.py",
      "    return streams\n", "    return [None] * copies\n",
      ("tests/test_fp8.py", "-k", "captured_on_a_stream_of_its_own"),
      "graph copies share their capture stream's cuBLAS workspace and corrupt each other's GEMMs when they replay "
      "at once"),
    M("packed-cudnn-attention-accepted-on-a-cpu", "bertqa_bench/backends/torch_backend.py",
      '            if o.packed_attention != "flash":\n', '            if False:\n',
      ("tests/test_fp8.py", "-k", "packed_attention_option"),
      "a CPU variant asking for cuDNN's attention silently runs the per-sequence SDPA loop"),
    M("fp8-attention-output-at-the-inverse-scale", "bertqa_bench/backends/transforms/fp8_surgery.py",
      "sa.o_inv_scale = torch.tensor(1.0 / dense.act_scale_value, dtype=torch.float32",
      "sa.o_inv_scale = torch.tensor(dense.act_scale_value, dtype=torch.float32",
      ("tests/test_fp8.py", "-k", "fp8_attention_swaps"),
      "FP8 attention writes its e4m3 output at the inverse of the scale the attention-output GEMM reads it at"),
    M("fp8-attention-padded-path-forgets-the-qkv-scale", "bertqa_bench/backends/transforms/fp8_modules.py",
      "qkv = (qkv.float() * self.qkv_out_scale).to(self.qkv.act_dtype)", "qkv = qkv.float().to(self.qkv.act_dtype)",
      ("tests/test_fp8.py", "-k", "fp8_attention_swaps"),
      "the padded model reads e4m3 Q, K, V without their output scale"),
    M("attention-output-e4m3-never-reaches-the-encoder", "bertqa_bench/backends/transforms/fp8_surgery.py",
      'elif attention_output == "e4m3" and out in swapped:', 'elif attention_output == "e4m3" and out in ():',
      ("tests/test_fp8.py", "-k", "hands_the_output_gemm"),
      "fp8.attention_output: e4m3 is accepted but no layer's attention writes e4m3: the row measures the fp16 path"),
    M("triton-attention-e4m3-output-left-to-the-cast", "bertqa_bench/kernels/_varlen_attention_triton.py",
      "out = round_to_e4m3(out)", "out = tl.minimum(tl.maximum(out, -448.0), 448.0)",
      ("tests/test_triton_attention.py", "-k", "interpreter"),
      "the interpreter's e4m3 output is left to its truncating cast, not rounded to nearest"),
    M("round-to-e4m3-without-subnormals", "bertqa_bench/kernels/_varlen_attention_triton.py",
      "step_exp = tl.maximum(exp, 127 - 6) - 3", "step_exp = exp - 3",
      ("tests/test_triton_attention.py", "-k", "interpreter"),
      "values below 2^-6 are rounded on a grid finer than e4m3's subnormals, then cast again"),
    M("first-real-batch-packed-without-its-token-types", "bertqa_bench/backends/torch_backend.py",
      "    return encoder.pack(ids, mask, types)[:4]", "    return encoder.pack(ids, mask, None)[:4]",
      ("tests/test_fp8.py", "-k", "first_call_before_capture"),
      "the batch the attention tile is tuned on is not the run's: every token gets segment 0"),
    M("tile-tuned-on-the-shortest-sample-batch", "bertqa_bench/backends/torch_backend.py",
      "    return order[(len(order) - 1) // 2]", "    return order[0]",
      ("tests/test_fp8.py", "-k", "median_mean_length"),
      "the attention tile is tuned on the plan's shortest sequences, not on a typical batch"),
    M("explicit-attention-tile-ignored", "bertqa_bench/kernels/varlen_attention.py",
      "    kernel, tile = (_tuned(), {}) if config is None else (_kernel(), config.all_kwargs())",
      "    kernel, tile = (_tuned(), {})",
      ("tests/test_triton_attention.py", "-k", "interpreter"),
      "the kernel bench's tile sweep times the autotuner's tile under every other tile's name"),
    M("tile-sweep-counted-in-the-pass-estimate", "scripts/kernel_bench.py",
      '        if rec.get("what") == "attention" and "error" not in rec and "us_median" in rec.get("graph", {}):',
      '        if "error" not in rec and "us_median" in rec.get("graph", {}):',
      ("tests/test_kernel_bench.py", "-k", "pass_records"),
      "the kernel's pass estimate averages in every tile the sweep timed, not the tuned one alone"),
    M("tile-sweep-counts-a-wrong-tile", "scripts/kernel_bench.py",
      '        good = ("error" not in r and r.get("within_bound") is True and r.get("graph_replay_equals_eager") is True',
      '        good = ("error" not in r and r.get("graph_replay_equals_eager") is True',
      ("tests/test_kernel_bench.py", "-k", "ran_right_everywhere"),
      "a fast tile that computes the wrong attention is recommended as the best"),
    # --- training
    M("graphed-layers-share-one-static-input", "bertqa_bench/training/graphed_layers.py",
      "                        for _ in calls)", "                        for _ in calls)[:1] * len(calls)",
      ("tests/test_train_speed.py", "-k", "every_parameter"),
      "every layer's backward reads the last layer's input: wrong weight gradients"),
    M("allreduce-hook-is-a-compressing-one", "bertqa_bench/training/steps.py",
      '{"allreduce": default_hooks.allreduce_hook,', '{"allreduce": default_hooks.fp16_compress_hook,',
      ("tests/test_train_speed.py", "-k", "allreduce_hook"),
      "the FP32 all-reduce hook rounds the gradients to FP16 on the way"),
    M("ddp-hook-efficiency-from-its-own-series-only", "bertqa_bench/reporting/scaling.py",
      "one.get((r.job, r.host, r.series)) or (one.get((r.job, r.host, r.baseline_series))",
      "one.get((r.job, r.host, r.series)) or (None",
      ("tests/test_scaling.py", "-k", "ddp_only"),
      "a comm hook's 4-GPU rows get no scaling efficiency (host L's table had none)"),
    M("scaling-denominator-is-the-last-one-gpu-row", "bertqa_bench/reporting/scaling.py",
      "(key not in one or rate > one[key].samples_per_s)", "True",
      ("tests/test_scaling.py", "-k", "several_one_gpu"),
      "with two 1-GPU runs in a series, the efficiency depends on which was listed last"),
    M("prepared-mask-drops-the-padding", "bertqa_bench/training/prepared_mask.py",
      "        if not padded:\n            return None", "        if padded:\n            return None",
      ("tests/test_host_sync.py", "-k", "prepared_mask_gives"),
      "padded batches attend to their padding (the model sees no mask), unpadded ones get one"),
    M("prepared-mask-still-asks-the-device", "bertqa_bench/training/prepared_mask.py",
      "allow_is_bidirectional_skip=False)", "allow_is_bidirectional_skip=True)",
      ("tests/test_host_sync.py", "-k", "prepared_mask_gives"),
      "transformers still reads the mask back to the host every forward (the sync stays)"),
    M("prepared-mask-for-any-model", "bertqa_bench/training/prepared_mask.py",
      'if (getattr(config, "model_type", None) in ENCODER_TYPES and not', "if (not",
      ("tests/test_host_sync.py", "-k", "outside_the_known"),
      "a causal model that imports the same mask function gets a bidirectional 4-D mask"),
    M("loss-readback-reads-at-once", "bertqa_bench/training/loss_readback.py",
      "        if not self.defer:", "        if True:",
      ("tests/test_host_sync.py", "-k", "deferred_loss_arrives"),
      "every logged loss is read at once: a host sync every log step"),
    M("graphed-layers-gradients-set-to-none", "bertqa_bench/training/optimizer_step.py",
      "self.optimizer.zero_grad(set_to_none=self.zero_to_none)", "self.optimizer.zero_grad(set_to_none=True)",
      ("tests/test_train_speed.py", "-k", "zeroed_in_place"),
      "under CUDA-graphed layers a gradient can become graph memory the next replay overwrites"),
    # --- configuration
    M("config-nan-timeout-loads", "bertqa_bench/config.py",
      'if not 0 < self.timeout_s < float("inf"):\n            raise ConfigError(f"bench.timeout_s',
      'if self.timeout_s <= 0:\n            raise ConfigError(f"bench.timeout_s',
      ("tests/test_fuzz.py", "-k", "found_suites"), "timeout_s: .nan loads, and never kills a hung backend"),
    # --- training: compile before the clock, the graphed optimizer step's safety check
    M("train-warmup-keeps-its-dropout-draws", "bertqa_bench/training/steps.py",
      "        torch.cuda.set_rng_state(cuda_rng, device)\n    torch.set_rng_state(cpu_rng)\n",
      "        torch.cuda.set_rng_state(cuda_rng, device)\n",
      ("tests/test_train_speed.py", "-k", "before_the_clock"),
      "the warm-up's dropout draws shift the timed run's RNG: another model than without the warm-up"),
    M("train-warmup-misses-the-unmasked-graph", "bertqa_bench/training/train.py",
      "return rows_n, trim, bool((self.lengths[rows] == trim).all())",
      "return rows_n, trim, False",
      ("tests/test_train_speed.py", "-k", "before_the_clock"),
      "a bucket with no padding (HF's BERT drops the mask: another graph) is compiled inside the timed loop"),
    # --- OpenVINO: the precision it really ran, the head kept fp32
    M("openvino-fp32-left-to-the-plugin", "bertqa_bench/backends/exported/openvino.py",
      '        hint = "bf16" if o.precision == "bf16" else "f32"',
      '        hint = "bf16"',
      ("tests/test_backends.py", "-k", "openvino_fp32"),
      "fp32 rows run in the plugin's own choice (bf16 on a BF16 CPU) and are reported as fp32"),
    M("openvino-int8-quantizes-the-head", "bertqa_bench/backends/exported/openvino.py",
      "        head = _head_nodes(model) if s.exclude_head else []",
      "        head = []",
      ("tests/test_backends.py", "-k", "openvino_int8"), "the QA head's GEMM is quantized though exclude_head says fp32"),
    # --- batches in flight: the runner overlaps, and collects in order
    M("stream-collects-at-once", "bertqa_bench/measuring/runner.py",
      "in_flight_window(submitted, backend.in_flight())", "in_flight_window(submitted, 1)",
      ("tests/test_runner.py", "-k", "in_flight"),
      "a pipelined backend is collected right after each submit: no overlap, measured as if it had some"),
    M("stream-collects-newest-first", "bertqa_bench/measuring/runner.py",
      "        if len(pending) >= max(1, int(depth)):\n            yield pending.popleft()",
      "        if len(pending) >= max(1, int(depth)):\n            yield pending.pop()",
      ("tests/test_runner.py", "-k", "in_flight"), "batches collected out of submission order"),
    M("offline-ignores-batches-in-flight", "bertqa_bench/measuring/loadgen_sut.py",
      "in_flight_window(submitted(), self.backend.in_flight())", "in_flight_window(submitted(), 1)",
      ("tests/test_loadgen.py", "-k", "pipelined"),
      "LoadGen Offline runs a pipelined backend one batch at a time, measuring less than bench does"),
    # --- LoadGen Server with batches in flight: the window, the error order, the predict time
    M("server-ignores-its-window", "bertqa_bench/measuring/loadgen_sut.py",
      "        in_flight = self.server_window > 1\n", "        in_flight = False\n",
      ("tests/test_loadgen.py", "-k", "server_keeps"),
      "LoadGen Server collects every batch before forming the next: a second CUDA stream stays idle under load"),
    M("server-window-gives-its-permit-back-before-the-error", "bertqa_bench/measuring/loadgen_sut.py",
      "        except BaseException as e:  # noqa: BLE001\n            traceback.print_exception(e)\n"
      "            self.error = self.error or f\"{type(e).__name__}: {e}\"\n            out = None\n"
      "        self._permits.release()\n",
      "        except BaseException as e:  # noqa: BLE001\n            self._permits.release()\n"
      "            traceback.print_exception(e)\n"
      "            self.error = self.error or f\"{type(e).__name__}: {e}\"\n            out = None\n"
      "        else:\n            self._permits.release()\n",
      ("tests/test_loadgen.py", "-k", "server_keeps"),
      "a batch formed while a failed one is still being recorded runs on instead of being answered empty"),
    M("server-batcher-keeps-a-permit-when-a-run-ends", "bertqa_bench/measuring/loadgen_sut.py",
      "                    if in_flight:\n                        self._permits.release()\n                    return\n",
      "                    return\n",
      ("tests/test_loadgen.py", "-k", "several_runs"),
      "each LoadGen run on one SUT leaves the window a batch smaller, until a peak-search run stalls"),
    M("server-keeps-the-permit-of-a-batch-answered-empty", "bertqa_bench/measuring/loadgen_sut.py",
      "            if not handed:  # a permit kept here would shrink the window for the rest of the run\n"
      "                self._permits.release()\n",
      "            pass\n",
      ("tests/test_loadgen.py", "-k", "server_keeps"),
      "after a failure the batches answered empty keep their permits: the batcher stalls and LoadGen waits"),
    M("server-span-starts-after-submit", "bertqa_bench/measuring/loadgen_sut.py",
      "_InFlight(submitted, time.perf_counter() - submitted[4])", "_InFlight(submitted, time.perf_counter())",
      ("tests/test_loadgen.py", "-k", "overlap_once"),
      "a Server batch's predict time leaves out the backend's own host part (submit)"),
    M("server-predict-time-sums-overlapping-batches", "bertqa_bench/measuring/loadgen_sut.py",
      "max(0.0, done - max(batch.started, self._spans_end))", "max(0.0, done - batch.started)",
      ("tests/test_loadgen.py", "-k", "overlap_once"),
      "overlapping Server batches' predict time counted twice: the SUT line's predict rate reads low"),
    # --- the suite's Triton attention kernel (its interpreter test runs it on the CPU)
    M("triton-attention-skips-the-partial-kv-block", "bertqa_bench/kernels/_varlen_attention_triton.py",
      "    if n_full < seqlen:\n", "    if False and n_full < seqlen:\n",
      ("tests/test_triton_attention.py", "-k", "interpreter"),
      "keys past the last full K/V block ignored: sequences whose length is not a multiple of the tile attend to fewer tokens"),
    M("triton-attention-keeps-the-old-accumulator-scale", "bertqa_bench/kernels/_varlen_attention_triton.py",
      "    acc = acc * alpha[:, None]\n", "",
      ("tests/test_triton_attention.py", "-k", "interpreter"),
      "the online softmax rescales the row sum but not the output accumulator when a later block raises the maximum"),
    # --- the same kernel on e4m3 Q, K, V (fp8.attention: fp8 with packed_attention: triton)
    M("e4m3-attention-scores-not-decoded", "bertqa_bench/kernels/_varlen_attention_triton.py",
      "        qk_scale = qk_scale * (s_qkv * s_qkv)\n", "",
      ("tests/test_attention_e4m3_inputs.py", "-k", "interpreter"),
      "the scores of e4m3 Q and K taken at code scale: the softmax sharpens or flattens by qkv_scale squared"),
    M("e4m3-attention-output-not-decoded", "bertqa_bench/kernels/_varlen_attention_triton.py",
      "        out_scale = out_scale * s_qkv\n", "",
      ("tests/test_attention_e4m3_inputs.py", "-k", "interpreter"),
      "the output of e4m3 V left at code scale: every attention output off by the factor qkv_scale"),
    M("e4m3-attention-p-not-rounded", "bertqa_bench/kernels/varlen_attention.py",
      "    if pv_e4m3:\n        return tl.float8e4nv", "    if False:\n        return tl.float8e4nv",
      ("tests/test_attention_e4m3_inputs.py", "-k", "interpreter"),
      "pv_e4m3 computing P V in fp16: the row named e4m3 P V is the fp16 path under another name"),
    M("e4m3-attention-tuned-as-the-fp16-pv-kernel", "bertqa_bench/kernels/varlen_attention.py",
      'key=["HEAD_DIM", "seq_bucket", "P_SCALE"]', 'key=["HEAD_DIM", "seq_bucket"]',
      ("tests/test_triton_attention.py", "-k", "autotuner_prunes"),
      "the e4m3 and fp16 P V kernels share one tuned tile: the second one run takes the first one's"),
    M("triton-attention-prunes-a-tile-that-fits", "bertqa_bench/kernels/varlen_attention.py",
      "return block_m * (block_n + head_dim) <= 128 * 32 * num_warps",
      "return block_m * (block_n + head_dim) < 128 * 32 * num_warps",
      ("tests/test_triton_attention.py", "-k", "ptxas"),
      "the autotuner never times a tile that ptxas compiles without spilling"),
    # --- residual add + LayerNorm + e4m3 quantize in one kernel (fp8.layernorm: triton)
    M("add-layernorm-one-pass-variance", "bertqa_bench/kernels/add_layernorm_fp8.py",
      "        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / hidden + e)\n",
      "        rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / hidden - mean * mean + e)\n",
      ("tests/test_add_layernorm_fp8.py", "-k", "interpreter"),
      "the variance as E[s^2] - E[s]^2: rows with a large mean lose it to cancellation"),
    M("add-layernorm-padding-columns-counted", "bertqa_bench/kernels/add_layernorm_fp8.py",
      "        d = tl.where(mask, s - mean[:, None], 0.0)", "        d = s - mean[:, None]",
      ("tests/test_add_layernorm_fp8.py", "-k", "interpreter"),
      "the columns past the hidden size (768 of a 1,024 tile) count -mean in the variance"),
    M("add-layernorm-y-scale-dropped", "bertqa_bench/kernels/add_layernorm_fp8.py",
      "        s = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32) * ys\n",
      "        s = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)\n",
      ("tests/test_add_layernorm_fp8.py", "-k", "interpreter"),
      "an e4m3 GEMM output added at code scale"),
    M("add-layernorm-x8-from-the-consumer-of-another-gemm", "bertqa_bench/backends/transforms/fp8_surgery.py",
      '(f"{here}.output.LayerNorm", f"{after}.attention.self"))',
      '(f"{here}.output.LayerNorm", f"{here}.intermediate"))',
      ("tests/test_fp8.py", "-k", "fused_layernorm_feeds"),
      "the FFN LayerNorm's e4m3 copy quantized at this layer's FFN-up scale, read by the next layer's QKV GEMM"),
    M("add-layernorm-copy-ignored", "bertqa_bench/backends/transforms/packed_encoder.py",
      "            h = layer.intermediate(x if x8 is None else x8)", "            h = layer.intermediate(x)",
      ("tests/test_fp8.py", "-k", "fused_layernorm_feeds"),
      "the kernel's e4m3 copy never read: the GEMM quantizes x again (the row pays for both)"),
    # --- the e4m3 output of the GEMMs before the LayerNorm kernel (fp8.dense_output: e4m3)
    M("dense-output-e4m3-read-at-code-scale", "bertqa_bench/backends/transforms/packed_encoder.py",
      "        return add_norm(output.dense.forward_e4m3(inp), residual, y_scale=y_scale)",
      "        return add_norm(output.dense.forward_e4m3(inp), residual)",
      ("tests/test_dense_output_e4m3.py", "-k", "hands_each_layernorm"),
      "the LayerNorm kernel adds the GEMM's e4m3 codes to the residual without their scale"),
    M("dense-output-e4m3-bias-dropped", "bertqa_bench/kernels/cublaslt_epilogues.py",
      "    y = (x8.float() @ w8.float().t()) * (x_scale.float() * w_scale.float()) + bias.float()\n"
      "    return (y * out_inv_scale.float()).clamp(-E4M3_MAX, E4M3_MAX)",
      "    y = (x8.float() @ w8.float().t()) * (x_scale.float() * w_scale.float())\n"
      "    return (y * out_inv_scale.float()).clamp(-E4M3_MAX, E4M3_MAX)",
      ("tests/test_dense_output_e4m3.py", "-k", "rounds_the_exact_value or forward_e4m3"),
      "the e4m3-output GEMM leaves out its bias (the 16-bit path adds it)"),
    M("dense-output-e4m3-only-the-first-gemm", "bertqa_bench/backends/transforms/fp8_surgery.py",
      "    done[\"dense_output_e4m3\"] = _dense_outputs_e4m3(model, done[\"fused_layernorms\"], dense_scales or {})",
      "    done[\"dense_output_e4m3\"] = _dense_outputs_e4m3(model, done[\"fused_layernorms\"][:1], dense_scales or {})",
      ("tests/test_dense_output_e4m3.py", "-k", "hands_each_layernorm"),
      "only the first fused LayerNorm's GEMM writes e4m3; the rest stay 16-bit and the option reports them"),
    M("dense-output-e4m3-without-a-gemm-pair", "bertqa_bench/backends/transforms/fp8_rules.py",
      '    pairs = {"attn_out", "ffn_in"} <= kinds or (fuse_qkv and {"ffn_out", "qkv"} <= kinds)',
      '    pairs = bool(set(RESIDUAL_GEMMS) & kinds)',
      ("tests/test_dense_output_e4m3.py", "-k", "options_are_checked"),
      "dense_output: e4m3 accepted where no FP8 GEMM reads the LayerNorm: a row that switches nothing"),
    M("dense-output-e4m3-switching-nothing-accepted", "bertqa_bench/backends/transforms/fp8_surgery.py",
      '    if dense_scales is not None and not done["dense_output_e4m3"]:',
      '    if False:',
      ("tests/test_dense_output_e4m3.py", "-k", "switches_no_gemm"),
      "keep_layers leaves no FP8 GEMM pair, and the e4m3-dense row times the base row under its name"),
    # --- a model the bench trains is evaluated once, by the reference row (commands/bench.py)
    M("bench-evaluates-its-model-twice", "bertqa_bench/commands/bench.py",
      "    evaluate = cfg.bench.reference != DEV_EVALUATOR\n", "    evaluate = True\n",
      ("tests/test_e2e.py", "-k", "end_to_end_cpu"),
      "a freshly trained model evaluated on dev, then again as the bench's reference row (46 s of a cold run)"),
    # --- a fine-tune whose loss fell and climbed back (training/loss_check.py)
    M("training-collapse-saved", "bertqa_bench/training/train.py",
      '    collapsed = _refuse_collapse(tc, loop["losses"], every, world, device, log)\n',
      "    collapsed = None\n",
      ("tests/test_loss_check.py", "-k", "refused_before"),
      "a collapsed fine-tune (dev F1 4) is saved, and the bench judges every row against it"),
    # --- a content-keyed cache entry finished by another process between our check and our rename
    M("atomic-dir-checks-then-renames", "bertqa_bench/io.py",
      "            if not replace and e.errno in (errno.ENOTEMPTY, errno.EEXIST) and path.is_dir():\n"
      "                shutil.rmtree(tmp, ignore_errors=True)\n                return\n",
      "",
      ("tests/test_runner.py", "-k", "cache_entry"),
      "two benches started together: the second to finish one evaluation set fails with ENOTEMPTY"),
    # --- manual GC: the collector really is off in the loop
    M("manual-gc-leaves-the-collector-on", "bertqa_bench/training/instrument.py",
      "            gc.freeze()\n            gc.disable()\n", "            gc.freeze()\n",
      ("tests/test_train_speed.py", "-k", "gc_watch"),
      "train.manual_gc reports itself on while Python's collector still runs inside the timed loop"),
    # --- a data-parallel run is judged against the reference's own outputs (end to end, ~1.5 min)
    M("data-parallel-judged-against-itself", "bertqa_bench/record/judging.py",
      "agreement=task.agreement(predictions, ref.predictions), ref_outputs=ref.outputs,",
      "agreement=task.agreement(predictions, ref.predictions), ref_outputs=outputs,",
      ("tests/test_e2e.py", "-k", "data_parallel_prediction"),
      "logit parity compares a backend's outputs with themselves, not with the reference's"),
]


def copy_tree(dest: Path) -> None:
    """The working tree as it is: tracked files and untracked ones git does not ignore."""
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listing):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_tests(work: Path, tests: tuple, timeout_s: float) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(work), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--no-header", *tests]
    try:
        p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout_s:.0f} s"
    return p.returncode, (p.stdout + p.stderr)[-3000:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", dest="select", default="", help="only mutants whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per test run")
    a = ap.parse_args(argv)
    mutants = [m for m in MUTANTS if a.select in m.name]
    if a.list:
        for m in mutants:
            print(f"{m.name:40s} {m.path}: {m.why}")
        return 0
    if not mutants:
        print(f"no mutant name contains '{a.select}'", file=sys.stderr)
        return 2
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bertqa-mutants-") as d:
        work = Path(d)
        copy_tree(work)
        # Baseline: the tests each mutant relies on pass on the unmutated copy.
        for tests in dict.fromkeys(m.tests for m in mutants):
            rc, out = run_tests(work, tests, a.timeout)
            if rc != 0:
                print(f"baseline FAILED (rc {rc}) for {' '.join(tests)}: mutants would be 'killed' by "
                      f"a test that fails anyway\n{out}", file=sys.stderr)
                return 2
        results = []
        for m in mutants:
            target = work / m.path
            original = target.read_text()
            n = original.count(m.old)
            if n != 1:
                results.append((m, "NOT APPLIED", f"target text found {n} times in {m.path}: update the mutant", 0.0))
                print(f"{'NOT APPLIED':12s} {m.name}", flush=True)
                continue
            target.write_text(original.replace(m.old, m.new))
            t0 = time.perf_counter()
            try:
                rc, out = run_tests(work, m.tests, a.timeout)
            finally:
                target.write_text(original)
            status = {0: "SURVIVED", 1: "KILLED"}.get(rc, "ERROR")
            results.append((m, status, out if status != "KILLED" else "", time.perf_counter() - t0))
            print(f"{status:12s} {m.name} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print()
    print(f"{'mutant':40s} {'result':12s} {'s':>5s}  tests")
    for m, status, _, s in results:
        print(f"{m.name:40s} {status:12s} {s:5.0f}  {' '.join(m.tests)}")
    bad = [(m, status, detail) for m, status, detail, _ in results if status != "KILLED"]
    killed = len(results) - len(bad)
    print(f"\n{killed}/{len(results)} mutants killed in {time.perf_counter() - t_all:.0f} s")
    for m, status, detail in bad:
        print(f"\n{status}: {m.name} — {m.why}\n  {m.path}\n{detail}", file=sys.stderr)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
