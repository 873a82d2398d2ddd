#!/usr/bin/env python3
"""Draws bus bandwidth against message size, one line per run, as a PNG
(gnuplot: Debian's gnuplot-nox).

  plot_busbw.py --out FILE.png [--title TEXT] [--op all_reduce] LABEL=ROWS ...

ROWS is a file of what a benchmark printed: collective_bench's rows (op,
size, count, type, redop, links, time, algbw, busbw, ...) or
../shared/anchors/run's ('all_reduce BYTES MEDIAN_US ALGBW BUSBW'); lines
starting with '#' are skipped, and so are rows of other operations than
--op. Each LABEL=ROWS is one line of the plot, e.g.

  collective_bench --op all_reduce --world 2 > dcomm.txt
  ../shared/anchors/run mpi 2 > mpi.txt
  plot_busbw.py --out all_reduce.png dcomm=dcomm.txt 'OpenMPI=mpi.txt'
"""
import argparse
import os
import subprocess
import sys
import tempfile


def rows_of(path, op):
    """(bytes, busbw GB/s) of each row of `op` in a benchmark's output."""
    points = []
    for line in open(path):
        words = line.split()
        if not words or words[0].startswith("#") or words[0] != op:
            continue
        try:
            if len(words) >= 9:  # collective_bench: busbw is the 9th column
                points.append((int(words[1]), float(words[8])))
            elif len(words) == 5:  # the anchors
                points.append((int(words[1]), float(words[4])))
        except ValueError:
            continue
    return sorted(points)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="")
    parser.add_argument("--op", default="all_reduce")
    parser.add_argument("runs", nargs="+", metavar="LABEL=ROWS")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plots = []
        for i, run in enumerate(args.runs):
            label, _, path = run.partition("=")
            if not path:
                parser.error(f"'{run}' is not LABEL=ROWS")
            points = rows_of(path, args.op)
            if not points:
                sys.exit(f"plot_busbw.py: no {args.op} rows in {path}")
            data = os.path.join(tmp, f"{i}.dat")
            with open(data, "w") as f:
                f.writelines(f"{b} {bw}\n" for b, bw in points)
            plots.append(f"'{data}' using 1:2 with linespoints title '{label}'")
        script = "\n".join([
            "set terminal png size 900,540 noenhanced",
            f"set output '{args.out}'",
            f"set title '{args.title or args.op}'",
            "set logscale x 2",
            "set format x '%.0b%BB'",
            "set xlabel 'message size (bytes)'",
            "set ylabel 'bus bandwidth (GB/s)'",
            "set key top left",
            "set grid",
            "plot " + ", ".join(plots),
        ])
        subprocess.run(["gnuplot"], input=script, text=True, check=True)


if __name__ == "__main__":
    main()
