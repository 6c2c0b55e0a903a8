"""Where a kernel's warps wait, from an Nsight Compute source page, as a page of text.

    # on the GPU machine: a report, then its source page as CSV
    ncu --set full -k regex:NAME -o REPORT python3 SCRIPT.py
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass -k regex:NAME > SOURCE.csv
    python benchmarks/ncu_source.py SOURCE.csv [--top 40]

For each kernel of the export (the page repeats its column header per kernel; kernels of the same
SASS, e.g. one kernel launched per batch chunk, are added up into one), prints:

* its executed warp instructions and warp-stall samples;
* per opcode (modifiers and predicates aside): executed instructions and stall samples, with
  their shares, the most sampled first;
* the stall reasons summed over the kernel (the columns ``stall_*``; ncu's "Not Issued"
  columns left out): e.g. ``long_sb``, the wait for a global load's result;
* the ``--top`` instructions with the most stall samples, in program order: row, executed
  count, samples, their two largest reasons, and the SASS.

Run it on the GPU machine and keep the text: the export is megabytes, the summary a page
(NOTES-gpu.md session 25 found the fused forward's prefetch waiting on its loads this way).
No GPU and nothing but the standard library is needed to read an export.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys

#: The opcode of a SASS line: an optional predicate (@P0, @!UP1, @PT), then the opcode.
_OPCODE = re.compile(r"^\s*(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
_SOURCE, _EXECUTED, _SAMPLES = "Source", "Instructions Executed", "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    """A cell as a number: ncu writes thousands separators; empty or text cells are 0."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def kernels(rows: list) -> list:
    """The kernels of an export's rows: ``[{"title", "header", "rows"}]``, one per header row
    (a row naming ``Source`` and ``Instructions Executed``); ``title`` is the last line before the
    header that is not a data row (ncu's kernel line, where it writes one), else ``""``."""
    found, title = [], ""
    for row in rows:
        if _SOURCE in row and _EXECUTED in row:
            found.append({"title": title, "header": row, "rows": []})
            title = ""
        elif found and len(row) == len(found[-1]["header"]):
            found[-1]["rows"].append(row)
        elif any(cell.strip() for cell in row):
            title = " ".join(cell.strip() for cell in row if cell.strip())
    return found


def _counted(name: str) -> bool:
    """Whether a column counts per instruction (added up over launches of the same SASS)."""
    return name in (_EXECUTED, _SAMPLES) or name.startswith("stall_")


def merged(found: list) -> list:
    """``found`` with the kernels of the same SASS (and columns) added up into the first of them:
    ``[(numbers of the kernels merged, kernel)]``."""
    groups = {}
    for number, kernel in enumerate(found, 1):
        header = kernel["header"]
        key = (tuple(header), tuple(row[header.index(_SOURCE)] for row in kernel["rows"]))
        if key not in groups:
            groups[key] = ([number], {"title": kernel["title"], "header": header,
                                      "rows": [list(row) for row in kernel["rows"]]})
            continue
        numbers, total = groups[key]
        numbers.append(number)
        for mine, theirs in zip(total["rows"], kernel["rows"]):
            for i, name in enumerate(header):
                if _counted(name):
                    mine[i] = repr(_number(mine[i]) + _number(theirs[i]))
    return list(groups.values())


def summary(kernel: dict, top: int = 40) -> str:
    """The text of one kernel (see the module's docstring)."""
    header = kernel["header"]
    at = {name: i for i, name in enumerate(header)}
    missing = [name for name in (_SOURCE, _EXECUTED, _SAMPLES) if name not in at]
    if missing:
        raise ValueError(f"the export has no column {missing[0]!r}: export it with --page source --csv "
                         f"--print-source sass from a report made with --set full (columns: {header[:6]}...)")
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    rows = kernel["rows"]
    executed = [_number(row[at[_EXECUTED]]) for row in rows]
    samples = [_number(row[at[_SAMPLES]]) for row in rows]
    total_executed, total_samples = sum(executed), sum(samples)
    per_opcode = collections.defaultdict(lambda: [0.0, 0.0])
    for row, e, s in zip(rows, executed, samples):
        match = _OPCODE.match(row[at[_SOURCE]])
        tally = per_opcode[match.group(1) if match else "?"]
        tally[0] += e
        tally[1] += s

    def share(part, whole):
        return 100.0 * part / whole if whole else 0.0

    lines = [f"{kernel['title'] or 'kernel'}: {len(rows)} SASS instructions, {total_executed:,.0f} warp "
             f"instructions executed, {total_samples:,.0f} stall samples",
             "  opcode        executed      %   samples      %"]
    for opcode, (e, s) in sorted(per_opcode.items(), key=lambda item: (-item[1][1], -item[1][0]))[:top]:
        lines.append(f"  {opcode:<10} {e:11,.0f} {share(e, total_executed):6.1f} {s:9,.0f} {share(s, total_samples):6.1f}")
    if reasons:
        sums = sorted(((sum(_number(row[at[r]]) for row in rows), r) for r in reasons), reverse=True)
        lines.append("  stall reasons: " + (", ".join(f"{r[len('stall_'):]} {share(v, total_samples):.1f}%"
                                                      for v, r in sums if v > 0) or "none sampled"))
    lines.append(f"  the {top} instructions with the most samples, in program order (row, executed, samples, "
                 f"reasons, SASS):")
    for i in sorted(sorted(range(len(rows)), key=lambda i: -samples[i])[:top]):
        if samples[i] <= 0:
            continue
        row = rows[i]
        main = sorted(((_number(row[at[r]]), r[len("stall_"):]) for r in reasons), reverse=True)[:2]
        why = " ".join(f"{r}:{v:.0f}" for v, r in main if v > 0)
        lines.append(f"  {i:5d} {executed[i]:11,.0f} {samples[i]:7,.0f}  {why:<28} {row[at[_SOURCE]].strip()}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", help="the CSV of `ncu -i REPORT --page source --csv --print-source sass`")
    parser.add_argument("--top", type=int, default=40, help="opcodes and instructions listed per kernel")
    args = parser.parse_args(argv)
    try:
        with open(args.export, newline="") as handle:
            found = kernels(list(csv.reader(handle)))
    except OSError as error:
        parser.error(f"export: {error}")
    if not found:
        parser.error(f"export: {args.export} has no source page (no row naming {_SOURCE!r} and {_EXECUTED!r})")
    for numbers, kernel in merged(found):
        try:
            text = summary(kernel, args.top)
        except ValueError as error:
            parser.error(str(error))
        print(f"kernel {' + '.join(map(str, numbers))}, {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
