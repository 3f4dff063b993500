"""The audit on a terminal: a progress bar per probe while it runs, then tables of probes and findings."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from isolation.audit.report import Report

_SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow"}
_STATUS_STYLE = {"passed": "green", "findings": "bold red", "skipped": "yellow", "incomplete": "yellow"}
_VERDICT = {
    "clean": "[bold green]clean[/]: no probe found a way for one request to see another's data",
    "findings": "[bold red]FINDINGS[/]: this endpoint does not isolate requests (details above)",
    "could not run": "[bold yellow]could not run[/]",
    "incomplete": "[bold yellow]incomplete[/]: not every probe ran; this is not a clean bill",
}


class ProgressBars:
    """An Observer drawing one bar per phase; silent when the console is not a terminal (CI logs, tests)."""

    def __init__(self, console: Console) -> None:
        self._progress = Progress(
            TextColumn("{task.description:<14}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            disable=not console.is_terminal,
        )
        self._tasks: dict[str, TaskID] = {}
        self._current: str | None = None

    def __enter__(self) -> ProgressBars:
        self._progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._finish_current()
        self._progress.stop()

    def _finish_current(self) -> None:
        if self._current is not None:
            task = self._tasks[self._current]
            # A probe may end early (a skipped round, a refused fill): its bar still shows it is done.
            self._progress.update(task, completed=self._progress.tasks[task].total)

    def phase(self, name: str, steps: int) -> None:
        self._finish_current()
        self._current = name
        self._tasks[name] = self._progress.add_task(name, total=max(1, steps))

    def step(self, name: str) -> None:
        self._progress.advance(self._tasks[name])


def print_report(report: Report, console: Console) -> None:
    # Everything comes from the report's JSON form, so the terminal gets the same redaction as the file; and
    # everything the endpoint wrote is escaped, so its text is shown as text, never read as rich markup.
    data = report.to_json()
    console.print(f"[bold]Bulkhead audit[/] of {escape(data['endpoint'])}, model {escape(repr(data['model']))}")
    facts = data["endpoint_facts"]
    if facts is not None:
        capacity = "not exposed by the endpoint" if facts["stages"] else "not exposed"
        if facts["kv_capacity"]:
            capacity = f"{facts['kv_capacity']} tokens ({facts['kv_capacity_source']})"
        console.print(f"  limit      : {facts['limit']} tokens ({facts['limit_source']})")
        console.print(f"  KV cache   : {capacity}")
        for stage in facts["stages"]:
            style = "yellow" if stage["kv_capacity"] < facts["limit"] else "green"
            console.print(f"  stage      : [{style}]{escape(stage['statement'])}[/]")
            console.print(f"               [dim]from {escape(stage['kv_capacity_source'])}[/]")
        console.print(f"  counts     : {facts['token_counts']}")
        for note in facts["notes"]:
            console.print(f"  note       : {escape(note)}")
    console.print(f"  identities : {data['identities']}")
    console.print(f"  requests   : {data['requests']} in {data['duration_s']:.1f} s (seed {data['seed']})")
    if data["probes"]:
        console.print(_probe_table(data["probes"]))
    if data["findings"]:
        console.print(_finding_table(data["findings"]))
    if data["error"]:
        console.print(f"[yellow]stopped:[/] {escape(data['error'])}")
    console.print(f"verdict: {_VERDICT[report.verdict]} (exit code {report.exit_code})")


def _probe_table(probes: list[dict[str, Any]]) -> Table:
    table = Table(title="Probes", title_justify="left")
    table.add_column("probe")
    table.add_column("result")
    table.add_column("requests", justify="right")
    table.add_column("notes", overflow="fold")
    for probe in probes:
        notes = [reason for reason in (probe["skipped"], probe["incomplete"]) if reason]
        notes += probe["notes"][:3]
        if len(probe["notes"]) > 3:
            notes.append(f"(+{len(probe['notes']) - 3} more in the JSON report)")
        style = _STATUS_STYLE[probe["status"]]
        table.add_row(probe["name"], f"[{style}]{probe['status']}[/]", str(probe["requests"]), escape("\n".join(notes)))
    return table


def _finding_table(findings: list[dict[str, Any]]) -> Table:
    table = Table(title="Findings", title_justify="left", show_lines=True)
    table.add_column("severity")
    table.add_column("probe")
    table.add_column("finding", overflow="fold")
    table.add_column("evidence", overflow="fold")
    for finding in findings:
        sent, received = finding["sent"], finding["received"]
        evidence = (
            f"sent: {sent['identity']} {sent['prompt']}, {sent['prompt_tokens']} tokens, "
            f"{'stream' if sent['stream'] else 'non-stream'}\n"
            f"got: HTTP {received.get('status')}, usage {received.get('usage')}"
        )
        if "answer_excerpt" in received:
            evidence += f"\nanswer: {received['answer_excerpt'][:160]!r}"
        style = _SEVERITY_STYLE[finding["severity"]]
        title = f"{escape(finding['title'])}\n[dim]{escape(finding['detail'])}[/]"
        table.add_row(f"[{style}]{finding['severity']}[/]", finding["probe"], title, escape(evidence))
    return table
