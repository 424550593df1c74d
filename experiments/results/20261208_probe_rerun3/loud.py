# K34: a reward module that prints 10 MB at import
import sys
sys.stdout.write("x" * 10_000_000 + "\n")
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
