"""What the command line writes: completions (stdout and --output), progress (stderr), and
the run's summary (stdout and --summary-json)."""
import json
import os
import sys
import time

from nano.errors import writing


def print_completions(prompts: list[str], seqs, detokenize) -> None:
    """Each prompt and its completion on stdout; a rejected request's reason on stderr."""
    for i, (prompt, seq) in enumerate(zip(prompts, seqs)):
        if seq.finish_reason == "rejected":
            print(f"[{i}] rejected: {seq.error}", file=sys.stderr)
        else:
            print(f"[{i}] {prompt}\n{detokenize(seq)}\n")


def format_summary(s: dict) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["preemption_reasons"].items())) or "none"
    return "\n".join([
        f"requests            {s['requests']} ({s['rejected']} rejected)",
        f"tokens              {s['prompt_tokens']} prompt, {s['generated_tokens']} generated",
        f"wall time           {s['wall_s']:.2f} s",
        f"throughput          {s['output_tokens_per_s']:.1f} output tok/s, {s['total_tokens_per_s']:.1f} total tok/s",
        f"TTFT                p50 {s['ttft_p50_ms']:.1f} ms, p90 {s['ttft_p90_ms']:.1f} ms, p99 {s['ttft_p99_ms']:.1f} ms",
        f"time per out token  p50 {s['tpot_p50_ms']:.1f} ms, p90 {s['tpot_p90_ms']:.1f} ms, p99 {s['tpot_p99_ms']:.1f} ms",
        f"SLO attainment      {100 * s['slo_attainment']:.1f}% of requests, goodput {s['goodput_rps']:.2f} req/s; "
        f"{s['served_late']} served late, {s['rejected_late']} rejected as late",
        f"preemptions         {s['preemptions_swap']} swap, {s['preemptions_recompute']} recompute ({reasons})",
        f"prefix cache hits   {100 * s['prefix_cache_hit_rate']:.1f}% of prompt tokens",
        f"peak KV occupancy   {100 * s['peak_kv_occupancy']:.1f}%, {s['peak_running']} sequences in one step",
        f"steps               {s['steps']}, mean {s['mean_step_ms']:.1f} ms",
    ] + ([  # tensor parallelism only; the time includes waiting for the slowest rank
        f"all-reduce          {s['all_reduce_ms_per_step']:.1f} ms and "
        f"{s['all_reduce_bytes_per_step'] / 1e6:.2f} MB per step (mean, rank 0)",
    ] if s["all_reduce_bytes_per_step"] else []))


def write_summary(path: str | None, summary: dict) -> None:
    if path:
        with writing(path), open(path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, finished: int, generated: int) -> None:
        self.done += finished
        if not self.tty and self.done < self.total:
            return
        width = 30
        fill = width * self.done // max(self.total, 1)
        rate = generated / max(time.perf_counter() - self.start, 1e-9)  # of finished requests
        end = "\n" if self.done == self.total else ""
        print(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} requests, "
              f"{rate:.1f} tok/s", end=end, file=sys.stderr, flush=True)


class OutputFile:
    """--output F.jsonl: one JSON object per prompt, `index` its position in the input. Each
    is appended, and flushed, the moment its request finishes, so a run that is interrupted
    or killed keeps every finished completion; close() (at the end, and on Ctrl-C or an
    error) then puts them in input order in one step, a rename. The file is not touched
    before the first request finishes."""

    def __init__(self, path: str, prompts: list[str], decode):
        self.path, self.prompts, self.decode = path, prompts, decode
        self.records: dict[int, str] = {}  # index -> JSON line
        self.file = None

    def write(self, index: int, seq) -> None:
        record = {"index": index, "prompt": self.prompts[index], "text": self.decode(seq),
                  "token_ids": seq.output_token_ids, "finish_reason": seq.finish_reason,
                  "num_prompt_tokens": seq.num_prompt_tokens}
        if seq.error:
            record["error"] = seq.error
        self.records[index] = json.dumps(record, ensure_ascii=False) + "\n"
        with writing(self.path):
            if self.file is None:
                self.file = open(self.path, "w", encoding="utf-8")
            self.file.write(self.records[index])
            self.file.flush()

    def close(self) -> None:
        if self.file is None:
            return
        self.file.close()
        tmp = self.path + ".tmp"
        with writing(self.path):
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(self.records[i] for i in sorted(self.records))
            os.replace(tmp, self.path)
