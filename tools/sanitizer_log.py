"""compute-sanitizer's logs read into findings: memcheck / synccheck messages and racecheck
hazards summed per kind and place, with the warps on each side (tools/sanitize.py's verdicts)."""
from __future__ import annotations

import dataclasses
import os
import re
from collections import defaultdict

_PREFIX = re.compile(r"^=+ ?")
_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+errors?", re.I)
_RACECHECK_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+)\s+hazards?\s+displayed\s*"
                                r"\(\s*(\d+)\s+errors?,\s*(\d+)\s+warnings?\s*\)", re.I)
_RACE = re.compile(r"^(ERROR|WARNING|INFO):\s*Race reported between (Read|Write) access at "
                   r"(.+?)(?:\s*\[(\d+) hazards?\])?$", re.I)
_RACE_AND = re.compile(r"^and (Read|Write) access at (.+?)(?:\s*\[(\d+) hazards?\])?$", re.I)
_HAZARD = re.compile(r"^(ERROR|WARNING|INFO):\s*Potential (RAW|WAR|WAW) hazard detected at "
                     r"__shared__ (0x[0-9a-fA-F]+) in block \(([\d, ]+)\)", re.I)
_HAZARD_THREAD = re.compile(r"^(Read|Write) Thread \((\d+),\s*(\d+),\s*(\d+)\) at (.+)$", re.I)
_AT = re.compile(r"^at (.+)$")
_NOT_FINDINGS = re.compile(r"COMPUTE-SANITIZER|SUMMARY:|Target application returned|"
                           r"^No (?:hazards|errors)|^Saved host backtrace|^Host Frame", re.I)


@dataclasses.dataclass
class Finding:
    """Reports of one kind at one place, summed: `what` is a memcheck / synccheck message, a
    racecheck hazard type ("RAW") or a racecheck analysis pair ("Write / Read"); `where` the
    source line(s) as the sanitizer gave them (file:line, the other access's after " / ");
    warps: for racecheck hazards, the warps of each side (threadIdx.x // 32; with the
    kernels' 4-warp default partition, warps 0-3 are it and the others the workers)."""

    severity: str
    kernel: str
    what: str
    where: str
    count: int = 0
    warps: str = ""


@dataclasses.dataclass
class Report:
    """One sanitizer log, parsed. errors: ERROR SUMMARY's count (None: no such line);
    hazards / hazard_errors / hazard_warnings: RACECHECK SUMMARY's (None: no such line)."""

    errors: int | None = None
    hazards: int | None = None
    hazard_errors: int | None = None
    hazard_warnings: int | None = None
    analysis: list[Finding] = dataclasses.field(default_factory=list)
    hazard_reports: list[Finding] = dataclasses.field(default_factory=list)
    messages: list[Finding] = dataclasses.field(default_factory=list)

    def count(self) -> int | None:
        """Hazards displayed (racecheck) or errors; None without a summary line."""
        return self.hazards if self.hazards is not None else self.errors

    def findings(self) -> list[Finding]:
        return self.analysis or self.hazard_reports or self.messages


def where(text: str) -> tuple[str, str]:
    """(kernel, "file:line") of a sanitizer location, "0x98 in /p/f.py:59:kernel" or
    "kernel(args)+0x98 in /p/f.py:59" (either part may be missing: "")."""
    text = text.strip()
    kernel, rest = "", text
    at_offset = re.match(r"^(?:0x[0-9a-fA-F]+|(?P<fn>.+?)\+0x[0-9a-fA-F]+)"
                         r"(?:\s+in\s+(?P<rest>.+))?$", text)
    if at_offset:
        kernel, rest = at_offset.group("fn") or "", at_offset.group("rest") or ""
    source = ""
    line = re.match(r"^(?P<file>[^:\s]+):(?P<line>\d+)(?::(?P<fn>.+))?$", rest)
    if line:
        source = f"{os.path.basename(line.group('file'))}:{line.group('line')}"
        kernel = kernel or (line.group("fn") or "")
    elif rest and not kernel:
        kernel = rest
    return re.sub(r"\(.*\)$", "", kernel.strip()), source


def _warp_ranges(warps: set[int]) -> str:
    """{0, 1, 2, 3, 8} -> "0-3,8"."""
    runs, ordered = [], sorted(warps)
    for warp in ordered:
        if runs and warp == runs[-1][1] + 1:
            runs[-1][1] = warp
        else:
            runs.append([warp, warp])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def parse_log(text: str) -> Report:
    """A compute-sanitizer log (any tool; the "========= " prefix optional) into its summary
    counts and its findings grouped by (severity, kernel, kind, place)."""
    report = Report()
    lines = [_PREFIX.sub("", line.rstrip()) for line in text.splitlines()]
    analysis: dict[tuple, Finding] = {}
    hazards: dict[tuple, Finding] = {}
    hazard_warps: dict[tuple, tuple[set, set]] = defaultdict(lambda: (set(), set()))
    messages: dict[tuple, Finding] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if (m := _ERROR_SUMMARY.search(stripped)):
            report.errors = int(m.group(1))
        if (m := _RACECHECK_SUMMARY.search(stripped)):
            report.hazards, report.hazard_errors, report.hazard_warnings = map(int, m.groups())
        if (m := _RACE.match(stripped)):
            severity, first_kind, first_at, first_count = m.groups()
            first_kernel, first_source = where(first_at)
            pairs = []
            while i + 1 < len(lines) and (more := _RACE_AND.match(lines[i + 1].strip())):
                pairs.append(more.groups())
                i += 1
            for kind, at, count in pairs or [(first_kind, first_at, first_count)]:
                kernel, source = where(at)
                key = (severity.upper(), first_kernel or kernel, f"{first_kind} / {kind}",
                       f"{first_source} / {source}")
                found = analysis.setdefault(key, Finding(*key))
                found.count += int(count or first_count or 1)
        elif (m := _HAZARD.match(stripped)):
            severity, kind = m.group(1).upper(), m.group(2).upper()
            sides = []
            while i + 1 < len(lines) and len(sides) < 2 \
                    and (thread := _HAZARD_THREAD.match(lines[i + 1].strip())):
                sides.append(thread.groups())
                i += 1
            places = [where(side[4]) for side in sides]
            kernel = next((k for k, _ in places if k), "")
            place = " / ".join(f"{side[0]} {source}" for side, (_, source) in zip(sides, places))
            key = (severity, kernel, kind, place)
            found = hazards.setdefault(key, Finding(*key))
            found.count += 1
            for side, warps in zip(sides, hazard_warps[key]):
                warps.add(int(side[1]) // 32)
        elif stripped and line == line.lstrip() and not _NOT_FINDINGS.search(stripped):
            # a memcheck / synccheck message; its place is on the next indented "at ..." line
            kernel = source = ""
            j = i + 1
            while j < len(lines) and lines[j].startswith((" ", "\t")):
                if (at := _AT.match(lines[j].strip())) and not source:
                    kernel, source = where(at.group(1))
                j += 1
            message = re.sub(r"0x[0-9a-fA-F]+", "0x..", stripped)
            severity = "WARNING" if stripped.lower().startswith("warning") else "ERROR"
            key = (severity, kernel, message, source)
            messages.setdefault(key, Finding(*key)).count += 1
            i = j - 1
        i += 1
    for key, found in hazards.items():
        first, second = hazard_warps[key]
        found.warps = f"warps {_warp_ranges(first)} / {_warp_ranges(second)}"
    report.analysis = sorted(analysis.values(), key=lambda f: -f.count)
    report.hazard_reports = sorted(hazards.values(), key=lambda f: -f.count)
    report.messages = sorted(messages.values(), key=lambda f: -f.count)
    return report


def describe(findings: list[Finding], limit: int = 4) -> str:
    parts = [f"{f.kernel or '?'}: {f.what} {f.where} [{f.count}]" + (f" {f.warps}" if f.warps
                                                                       else "")
             for f in findings[:limit]]
    if len(findings) > limit:
        parts.append(f"+{len(findings) - limit} more")
    return "; ".join(parts)
