"""What the compiler made of the hot native kernels: prefetches and FMA / vpdpbusd instructions per
kernel, counted in a built module's disassembly.

The kernels stream weights and KV from memory, so a kernel that lost its prefetches (GCC drops an
inlined function whose only effect is a prefetch) or its fused multiply-adds (a helper no longer
inlined into its target-attributed caller) runs slower with the same bits. Symbols move between
source files as the kernels are reorganised, so kernels are matched by their demangled function
name (namespaces and parameter lists dropped, template arguments kept), summed over clones and
OpenMP-outlined parts.

    python bench/kernel_census.py [MODULE.so] [--json OUT] [--compare BEFORE.json]

Without MODULE.so, the module this checkout builds (kvbank.kernels). Needs binutils' objdump.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

#: kernel family -> pattern on the normalised name; the first that matches names its family
FAMILIES = (
    ("matmul amx", r"^amx_"),
    ("matmul avx512_vnni", r"^((group|pair)_avx512|vnni_|quantize_row_avx512|QuantRows::quantize_row_avx512)"),
    ("matmul avx2", r"^(group_avx2|avx2_group|QuantRows::quantize_row_avx2)"),
    ("matmul scalar", r"^(group_scalar|QuantRows::quantize_row_scalar)"),
    ("matmul dispatch", r"^(qmatmul_groups|qmatmul_span|group_kernel)"),
    ("quant attention avx512_bf16", r"^(quant_range512_lut|kivi4_range512_bf16)"),
    ("quant attention avx512", r"^quant_range512_f\b|^quant_range512_f<"),
    ("quant attention avx2", r"^(quant_range<|quant_rows<)"),
    ("quant attention scalar", r"^quant_range_scalar<"),
    ("dense attention avx512_bf16", r"^attend_range_bf16<"),
    ("dense attention scalar", r"^attend_range<"),
    ("stack forward", r"^QuantStack::forward"),
)
PREFETCH = re.compile(r"^prefetch")
FMA = re.compile(r"^v?f(n)?m(add|sub)")
DPBUSD = re.compile(r"^(vpdpbusds?|tdpb[su]{2}d)")


def normalise(name: str) -> str:
    """A demangled symbol without namespaces, parameter list or clone suffix; template arguments kept."""
    name = re.sub(r"\s*\[clone [^\]]*\]", "", name)
    name = name.replace("(anonymous namespace)::", "").replace("kvbank::", "").replace("c10::", "")
    # drop the parameter list: the last top-level parenthesis group
    depth, cut = 0, None
    for i in range(len(name) - 1, -1, -1):
        if name[i] == ")":
            depth += 1
        elif name[i] == "(":
            depth -= 1
            if depth == 0:
                cut = i
                break
    if cut is not None and not name.startswith("("):
        name = name[:cut]
    return re.sub(r"^(void|int|long|float|bool|auto)\s+", "", name).strip()


def census(module: Path) -> dict[str, dict[str, int]]:
    """Per normalised kernel name: functions, instructions, prefetches, FMAs and vpdpbusd."""
    text = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "--demangle", str(module)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    current = None
    for line in text.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            if header.group(1).endswith("@plt"):  # a jump stub the linker made, not the kernel
                current = None
                continue
            name = normalise(header.group(1))
            current = counts[name] if any(re.search(p, name) for _, p in FAMILIES) else None
            if current is not None:
                current["functions"] += 1
            continue
        if current is None:
            continue
        parts = line.split("\t")
        if len(parts) < 2 or not parts[1].strip():
            continue
        mnemonic = parts[1].split()[0]
        current["instructions"] += 1
        current["prefetch"] += bool(PREFETCH.match(mnemonic))
        current["fma"] += bool(FMA.match(mnemonic))
        current["vpdpbusd"] += bool(DPBUSD.match(mnemonic))
    return {name: dict(c) for name, c in sorted(counts.items())}


def family_of(name: str) -> str:
    return next(family for family, pattern in FAMILIES if re.search(pattern, name))


def totals(kernels: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The counts summed per family."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for name, c in kernels.items():
        for key, value in c.items():
            out[family_of(name)][key] += value
    return {family: dict(out[family]) for family, _ in FAMILIES if family in out}


COLUMNS = ("functions", "instructions", "prefetch", "fma", "vpdpbusd")


def table(families: dict[str, dict[str, int]], before: dict[str, dict[str, int]] | None) -> str:
    width = max(len(f) for f, _ in FAMILIES)
    head = f"{'family':<{width}}  " + "  ".join(f"{c:>14}" for c in COLUMNS)
    rows = [head, "-" * len(head)]
    for family, _ in FAMILIES:
        now = families.get(family, {})
        then = before.get(family, {}) if before is not None else None
        cells = []
        for c in COLUMNS:
            cell = str(now.get(c, 0))
            if then is not None:
                cell = f"{then.get(c, 0)} -> {cell}"
            cells.append(f"{cell:>14}")
        rows.append(f"{family:<{width}}  " + "  ".join(cells))
    return "\n".join(rows)


def built_module() -> Path:
    from kvbank import kernels

    if kernels.native() is None:
        sys.exit(f"the native module is not built: {kernels.failure()}")
    return kernels.build_folder(kernels.module_name()) / f"{kernels.module_name()}.so"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", nargs="?", type=Path, help="a built kvbank_native_*.so (default: this checkout's)")
    parser.add_argument("--json", type=Path, help="write the per-kernel and per-family counts here")
    parser.add_argument("--compare", type=Path, help="a JSON written before, shown as before -> now")
    args = parser.parse_args()
    module = args.module or built_module()
    kernels = census(module)
    families = totals(kernels)
    before = json.loads(args.compare.read_text())["families"] if args.compare else None
    print(f"{module}\n{table(families, before)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"module": str(module), "families": families, "kernels": kernels}, indent=1))


if __name__ == "__main__":
    main()
