"""The command line's side of a run over several ranks (nano/disagg, nano/dp): rank 0's
requests as sequences, the progress bar, the --output file in input order, the report."""
import sys

from nano.cli.output import OutputFile, Progress, describe, print_completions, write_summary
from nano.telemetry.summary import format_summary


class RankRun:
    """Rank 0's side of a run over several ranks on the command line. workload: engine ->
    the run's requests (nano/cli/prompts.py's Workload), made on rank 0 once its engine is
    loaded."""

    def __init__(self, args, workload, banner: str):
        self.args, self.workload, self.banner = args, workload, banner
        self.generated, self.output = 0, None

    def make_requests(self, engine) -> list:
        seqs, self.prompts = sequences(engine, self.workload)
        self.index = {seq.seq_id: i for i, seq in enumerate(seqs)}
        self.progress = Progress(len(seqs))
        if self.args.output:
            self.output = OutputFile(self.args.output, self.prompts, engine.detokenize)
        print(f"{self.banner}; each {describe(engine)}", file=sys.stderr)
        return seqs

    def on_result(self, seq, **where) -> None:
        """A request's end; where: what the --output line says of where it ran (replica=...)."""
        self.generated += seq.num_output_tokens
        self.progress.update(1, self.generated)
        if self.output:
            self.output.write(self.index[seq.seq_id], seq, **where)

    def close(self) -> None:
        if self.output:
            self.output.close()

    def report(self, ran, summarize, format_add_on) -> int:
        """Rank 0 at the end (ran: launch's (router, engine, wall seconds); None on the other
        ranks): the completions in input order (not --bench's random tokens), the summary,
        the add-on's own lines."""
        if ran is None:
            return 0
        router, engine, wall = ran
        if not self.args.bench:
            seqs = sorted(router.results.values(), key=lambda q: self.index[q.seq_id])
            print_completions(self.prompts, seqs, engine.detokenize)
        summary = summarize(router, wall)
        print(format_summary(summary))
        print(format_add_on(summary))
        write_summary(self.args.summary_json, summary)
        return 0


def sequences(engine, workload):
    """The run's requests as sequences (arrival times in seconds after the start), and their
    prompts' text for the output."""
    w = workload(engine)
    arrivals = [0.0] * len(w.inputs) if w.arrivals is None else w.arrivals
    return [engine.make_sequence(p, sp, t) for p, sp, t in zip(w.inputs, w.per_request, arrivals)], w.prompts
