"""Print the top functions of cProfile dumps (a profiling aid for the device runs)."""
import pstats
import sys

for path in sys.argv[1:]:
    print(f"== {path}")
    pstats.Stats(path).sort_stats("tottime").print_stats(28)
