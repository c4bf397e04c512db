#!/usr/bin/env bash
# Plots a soak run's RSS samples (the CSV of `harrier bench soak --rss-csv`): one panel per
# process, MB against requests done. Needs gnuplot (Debian: gnuplot-nox).
#
#   scripts/soak_plot.sh target/soak/rss.csv target/soak/rss.png
set -euo pipefail
CSV="$1"
PNG="${2:-${CSV%.csv}.png}"
# Columns: t_s, phase, sent, done, then one <name>_rss_kb per process.
read -r HEADER <"$CSV"
IFS=, read -r -a COLS <<<"$HEADER"
N=$((${#COLS[@]} - 4))
{
    echo "set datafile separator ','"
    echo "set terminal pngcairo size 1000,$((220 * N + 60)) font ',10'"
    echo "set output '$PNG'"
    echo "set multiplot layout $N,1 title 'RSS over the soak run (MB; load phase, then settle)'"
    echo "set xlabel 'requests done'"
    echo "set ylabel 'MB'"
    echo "set grid"
    echo "set key off"
    echo "set yrange [0:*]"
    for ((i = 0; i < N; i++)); do
        col=$((i + 5))
        name="${COLS[$((i + 4))]%_rss_kb}"
        echo "set title '$name'"
        echo "plot '$CSV' every ::1 using 4:(\$$col/1024) with lines lw 2"
    done
    echo "unset multiplot"
} | gnuplot
echo "wrote $PNG"
