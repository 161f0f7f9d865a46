"""Per-source-line summary of an Nsight Compute source view: where a kernel's warps stall.

Usage: python scripts/ncu_lines.py SOURCE_CSV[.gz] [lines]
SOURCE_CSV: `ncu -i rep.ncu-rep --page source --csv -k regex:NAME --print-source cuda,sass`
(docs/optimisation.md, "How to measure"). Prints the source lines with the most warp-stall
samples, each with its stall reasons and its shared-memory wavefronts, L2 sectors and
instructions (with the excess ncu attributes to them). The CSV has quoted line breaks, so it
is read as one stream, and the SASS rows under each source line are skipped.
"""
import collections
import csv
import gzip
import sys

METRICS = {"Instructions Executed": "instructions",
           "L1 Wavefronts Shared": "smem wavefronts",
           "L1 Wavefronts Shared Excessive": "excess smem wavefronts",
           "L2 Theoretical Sectors Global": "L2 sectors",
           "L2 Theoretical Sectors Global Excessive": "excess L2 sectors"}


def summarise(path: str):
    """(samples, stall reasons, metrics, source text) per (file, line)."""
    opener = gzip.open if path.endswith(".gz") else open
    samples, stalls = collections.Counter(), collections.defaultdict(collections.Counter)
    metrics, text = collections.defaultdict(collections.Counter), {}
    name, header = None, None
    with opener(path, "rt", newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "File Path":
                name = row[1].rsplit("/", 1)[-1]
            elif row[0] == "Line No":
                header = row
            elif header and row[0].isdigit() and len(row) == len(header):
                key = (name, int(row[0]))
                text[key] = row[1]
                samples[key] += int(row[4] or 0)
                for i, h in enumerate(header):
                    if row[i] in ("", "-"):
                        continue
                    if h.startswith("stall_") and "Not Issued" not in h:
                        stalls[key][h[6:]] += int(row[i])
                    elif h in METRICS:
                        metrics[key][METRICS[h]] += int(row[i])
    return samples, stalls, metrics, text


def main() -> int:
    samples, stalls, metrics, text = summarise(sys.argv[1])
    total = sum(samples.values()) or 1
    print(f"{total} warp-stall samples")
    for key, n in samples.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 25):
        reasons = ", ".join(f"{k} {v}" for k, v in stalls[key].most_common(6) if v)
        counts = ", ".join(f"{k} {metrics[key][k]}" for k in METRICS.values() if metrics[key][k])
        print(f"{100 * n / total:5.1f}%  {key[0]}:{key[1]}  {text[key][:90]}\n"
              f"        stalls: {reasons}\n        {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
