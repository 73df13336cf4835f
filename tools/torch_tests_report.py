"""One markdown table per torch test file: each test's outcome with jitattn off, as torch's flash
provider and as the varlen drop-in, jitattn's calls, and why (a small table of known causes).

    python3 tools/torch_tests_report.py JUNIT_DIR [--tests-dir .torchtests/test] [-o report.md]

JUNIT_DIR holds `<file stem>.<mode>.xml` (tools/torch_tests_with_jitattn.sh writes them, from
pytest's --junitxml with tools/jitattn_torch_tests_plugin.py, whose per-test junit properties
`jitattn_forward/backward/fallback` count jitattn's calls). Parametrizations of one test are
grouped where every mode's outcome, whether jitattn was reached, and the reason agree; a test's
name is matched to the `def test_*` names of its file when --tests-dir has the file, so that
`test_varlen_vs_sdpa_bfloat16_..._cuda` groups under `test_varlen_vs_sdpa`. A mode whose file
did not import (a collection error) marks every test of the file with that error.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

MODES = ("off", "provider", "dropin")
COUNTED = ("forward", "backward", "fallback")
JUNIT_NAME = re.compile(r"^(?P<stem>.+)\.(?P<mode>off|provider|dropin)\.xml$")


@dataclasses.dataclass(frozen=True)
class Result:
    """One test in one mode, as its junit testcase says."""

    outcome: str  # passed, failed, error, skipped, not collected
    message: str = ""
    calls: tuple = (0, 0, 0)  # forward, backward, fallback during the test; None when not recorded

    @property
    def reached_jitattn(self) -> bool | None:
        if self.calls is None:
            return None
        return self.calls[0] + self.calls[1] > 0


@dataclasses.dataclass
class FileRun:
    """One test file in one mode: its results by test name, or why the file did not run."""

    results: dict
    collection_error: str | None = None


# ----------------------------------------------------------------------------- reading junit
def _first_line_of_interest(text: str) -> str:
    """The `E   ...` line of a traceback (the exception), else the first non-empty line."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("E ") and line[1:].strip():
            return line[1:].strip()
    return lines[0] if lines else ""


def parse_junit(source) -> FileRun:
    """A junit XML file (a path or its text) -> FileRun."""
    text = Path(source).read_text() if isinstance(source, Path) else source
    root = ET.fromstring(text)
    results, collection_error = {}, None
    for case in root.iter("testcase"):
        name = case.get("name", "")
        failure, error, skipped = case.find("failure"), case.find("error"), case.find("skipped")
        if error is not None and error.get("message") == "collection failure":
            collection_error = _first_line_of_interest(error.text) or "collection failure"
            continue
        if failure is not None:
            outcome, node = "failed", failure
        elif error is not None:
            outcome, node = "error", error
        elif skipped is not None:
            outcome, node = "skipped", skipped
        else:
            outcome, node = "passed", None
        message = ""
        if node is not None:
            message = node.get("message") or ""
            detail = _first_line_of_interest(node.text or "")
            if detail and detail not in message:
                message = f"{message} | {detail}" if message else detail
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        calls = None
        if any(f"jitattn_{kind}" in props for kind in COUNTED):
            calls = tuple(int(props.get(f"jitattn_{kind}", 0) or 0) for kind in COUNTED)
        results[name] = Result(outcome, message, calls)
    return FileRun(results, collection_error)


def load_dir(junit_dir: Path) -> dict:
    """{file stem: {mode: FileRun}} from the `<stem>.<mode>.xml` files of `junit_dir`."""
    runs: dict = collections.defaultdict(dict)
    for path in sorted(Path(junit_dir).iterdir()):
        match = JUNIT_NAME.match(path.name)
        if match:
            runs[match["stem"]][match["mode"]] = parse_junit(path)
    return dict(runs)


# ----------------------------------------------------------------------------- known causes
@dataclasses.dataclass(frozen=True)
class Cause:
    """A known reason for an outcome: applies when `mode`'s result (any mode if None) has one of
    `outcomes` and its message matches `message`, and the test's name matches `test`. `reason`
    may name the message's groups ({0}, {1}, ...)."""

    reason: str
    outcomes: tuple = ("failed", "error", "not collected")
    message: str = ""
    mode: str | None = None
    test: str = ""
    fallback_only: bool = False  # applies only where jitattn handed every call to torch's kernel

    def explain(self, name: str, mode: str, result: Result) -> str | None:
        """The reason for this result, or None where the cause does not apply."""
        if (self.mode is not None and self.mode != mode) or result.outcome not in self.outcomes:
            return None
        if self.fallback_only and not (result.calls and result.calls[0] + result.calls[1] == 0 and result.calls[2]):
            return None
        found = re.search(self.message, result.message or "")
        if found is None or re.search(self.test, name) is None:
            return None
        return self.reason.format(*found.groups())


def _missing(what: str) -> str:
    return f"this torch's varlen_attn lacks `{what}` (test file newer than this torch)"


KNOWN_CAUSES = (
    Cause("TypeError in torch's own varlen_attn: the test file passes is_causal positionally (torch 2.9's API); "
          "this torch's varlen_attn is keyword-only after max_k (test file older than torch)",
          message=r"takes 7 positional arguments but 8 were given"),
    Cause("this torch's torch.nn.attention.varlen lacks `{0}`: the file does not import (test file newer than "
          "this torch)", message=r"cannot import name '(\w+)' from 'torch\.nn\.attention\.varlen'"),
    Cause("this torch's {1} lacks `{0}`: the file does not import (test file newer than this torch)",
          message=r"cannot import name '(\w+)' from '(torch\.[\w.]+)'"),
    Cause("the test file imports `{0}`, which is not beside it", message=r"No module named '([\w.]+)'"),
    *(Cause(_missing(arg), message=rf"unexpected keyword argument '{arg}'")
      for arg in ("enable_gqa", "seqused_k", "block_table", "num_splits", "return_aux", "window_size", "scale")),
    Cause("this torch's private varlen op has another schema than the test file's (test file newer than torch)",
          message=r"torch_attn\._varlen_attn\w*\(\) (?:expected|takes)|_varlen_attn\w* .*argument"),
    Cause("torch's private varlen op is missing in this torch", message=r"torch_attn.*(?:has no attribute|no op)"),
    Cause("needs FA3 / FA4 (flash_attn_interface / flash_attn.cute), not installed: not applicable",
          outcomes=("skipped",), message=r"FA[34] (?:backend )?not available|flash_attn_interface"),
    Cause("tests torch's cuDNN routing: jitattn's drop-in never routes to cuDNN (not applicable)",
          outcomes=("skipped",), message=r"[cC]u[dD][nN][nN]"),
    Cause("asserts torch's own ops were dispatched; in dropin jitattn's ops run instead (jitattn.varlen_attn*): "
          "intended", mode="dropin", test=r"custom_op_registration"),
    Cause("jitattn's lse is differentiable (beyond torch's API, docs/api.md): intended difference",
          mode="dropin", test=r"lse_is_not_differentiable"),
    Cause("opcheck of torch's private torch_attn ops: tests torch in every mode", test=r"custom_op_compliance",
          outcomes=("failed", "error")),
    Cause("tests torch's own varlen backend selection (private torch.nn.attention.varlen functions): not "
          "jitattn's", message=r"has no attribute '(?:_select_backend|_get_sdp_priority_order|_cudnn\w*)'"),
    Cause("tests sdpa_kernel forcing a varlen backend (cuDNN / math errors): jitattn's drop-in does not read "
          "sdpa_kernel (not applicable)", mode="dropin", test=r"sdpa_kernel_backend"),
    Cause("jitattn handed these calls to torch's kernel (its fallback: head dim, dropout, debug mask...)",
          outcomes=("passed", "failed", "error"), mode="provider", fallback_only=True),
    Cause("no CUDA GPU / flash attention on this machine", outcomes=("skipped",),
          message=r"Flash Attention not supported|CUDA not available|no CUDA|Only runs on cuda|requires CUDA"),
)


def reasons_for(name: str, results: dict, causes=KNOWN_CAUSES) -> str:
    """The known causes that explain a test's results across modes, '; '-joined (first match per mode)."""
    found = []
    for mode in MODES:
        result = results.get(mode)
        if result is None:
            continue
        for cause in causes:
            reason = cause.explain(name, mode, result)
            if reason is not None:
                if reason not in found:
                    found.append(reason)
                break
    return "; ".join(found)


# ----------------------------------------------------------------------------- grouping
def method_names_in(test_file: Path) -> list[str]:
    """The `def test_*` names in a test file, longest first (for prefix matching)."""
    names = set(re.findall(r"^\s*def (test_\w+)\s*\(", test_file.read_text(), flags=re.M))
    return sorted(names, key=len, reverse=True)


def family_of(name: str, known: list[str]) -> str:
    """The test method `name` was generated from (the longest known name it starts with), else `name`."""
    for base in known:
        if name == base or name.startswith(base + "_"):
            return base
    return name


def outcome_label(result: Result | None, mode: str) -> str:
    if result is None:
        return "—"
    label = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "skipped": "skip",
             "not collected": "not collected"}[result.outcome]
    if result.outcome == "passed" and mode != "off" and result.reached_jitattn is not None:
        label += " (jitattn ran)" if result.reached_jitattn else " (no jitattn call)"
    return label


@dataclasses.dataclass
class Row:
    family: str
    labels: tuple  # one outcome label per mode
    reason: str
    names: list = dataclasses.field(default_factory=list)
    calls: dict = dataclasses.field(default_factory=dict)  # mode -> [forward, backward, fallback]


def table_rows(runs: dict, known: list[str] | None = None, causes=KNOWN_CAUSES) -> list[Row]:
    """{mode: FileRun} of one test file -> its rows, grouped by family, outcomes and reason."""
    known = known or []
    names = []
    for run in runs.values():
        names += [n for n in run.results if n not in names]
    rows: dict = {}
    for name in names:
        per_mode = {}
        for mode in MODES:
            run = runs.get(mode)
            if run is None:
                continue
            if run.collection_error is not None:
                per_mode[mode] = Result("not collected", run.collection_error, None)
            elif name in run.results:
                per_mode[mode] = run.results[name]
        family = family_of(name, known)
        labels = tuple(outcome_label(per_mode.get(mode), mode) for mode in MODES)
        reason = reasons_for(name, per_mode, causes)
        row = rows.setdefault((family, labels, reason), Row(family, labels, reason))
        row.names.append(name)
        for mode, result in per_mode.items():
            if result.calls is not None:
                total = row.calls.setdefault(mode, [0, 0, 0])
                for i, count in enumerate(result.calls):
                    total[i] += count
    return sorted(rows.values(), key=lambda r: (r.family, r.labels, r.reason))


# ----------------------------------------------------------------------------- markdown
def _calls_text(row: Row) -> str:
    parts = []
    for mode in ("provider", "dropin"):
        if mode in row.calls:
            forward, backward, fallback = row.calls[mode]
            parts.append(f"{mode[0].upper()}: {forward} fwd / {backward} bwd / {fallback} fallback")
    return "<br>".join(parts) or "—"


def _cases_text(row: Row) -> str:
    if len(row.names) == 1 and row.names[0] == row.family:
        return "1"
    suffixes = [name[len(row.family) + 1:] or name for name in row.names]
    shown = ", ".join(f"`{s}`" for s in suffixes[:3])
    return f"{len(row.names)}: {shown}{', …' if len(suffixes) > 3 else ''}"


def summary_line(runs: dict) -> str:
    parts = []
    for mode in MODES:
        run = runs.get(mode)
        if run is None:
            parts.append(f"{mode}: not run")
        elif run.collection_error is not None:
            parts.append(f"{mode}: did not import ({run.collection_error})")
        else:
            counts = collections.Counter(r.outcome for r in run.results.values())
            parts.append(f"{mode}: " + ", ".join(f"{counts[o]} {o}" for o in ("passed", "failed", "error", "skipped")
                                                  if counts[o]) if counts else f"{mode}: no tests")
    return "; ".join(parts)


def markdown(stem: str, runs: dict, known: list[str] | None = None, causes=KNOWN_CAUSES) -> str:
    """One test file's section: a summary line per mode and the grouped table."""
    lines = [f"### {stem}.py", "", summary_line(runs), "",
             "| test | cases | off | provider | dropin | jitattn calls | reason |",
             "|---|---|---|---|---|---|---|"]
    for row in table_rows(runs, known, causes):
        reason = row.reason.replace("|", "\\|")
        lines.append(f"| `{row.family}` | {_cases_text(row)} | " + " | ".join(row.labels) +
                     f" | {_calls_text(row)} | {reason} |")
    return "\n".join(lines) + "\n"


def report(junit_dir: Path, tests_dir: Path | None = None) -> str:
    runs_by_file = load_dir(junit_dir)
    if not runs_by_file:
        raise SystemExit(f"no <stem>.<off|provider|dropin>.xml files in {junit_dir}")
    sections = []
    for stem, runs in sorted(runs_by_file.items()):
        test_file = tests_dir / f"{stem}.py" if tests_dir else None
        known = method_names_in(test_file) if test_file and test_file.is_file() else []
        sections.append(markdown(stem, runs, known))
    legend = ("pass (jitattn ran): passed, and jitattn's kernels computed calls during the test; pass (no jitattn "
              "call): passed with no jitattn forward/backward (torch's kernel ran, or the test never reached a kernel, "
              "e.g. an argument error). Calls: P provider, D dropin (dropin counts eager calls only).")
    return "\n".join(sections) + "\n" + legend + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit_dir", type=Path, help="folder of <stem>.<mode>.xml files")
    parser.add_argument("--tests-dir", type=Path, default=None,
                        help="folder of the torch test files (groups parametrizations under their test)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="write the markdown here too")
    args = parser.parse_args(argv)
    if not args.junit_dir.is_dir():
        parser.error(f"junit_dir {args.junit_dir} is not a folder")
    text = report(args.junit_dir, args.tests_dir)
    sys.stdout.write(text)
    if args.output:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
